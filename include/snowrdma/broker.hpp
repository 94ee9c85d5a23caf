/* snowrdma/broker.hpp: the RC message broker for C++17, header-only over
 * snowrdma/broker.h, with the seed's (RDMALib's) class and method names so
 * its users move with few edits:
 *
 *   RDMALib                         snowrdma
 *   NovaMsgCallback                 snowrdma::MsgCallback
 *   NovaRDMABroker                  snowrdma::RdmaBroker
 *   NovaRDMARCBroker                snowrdma::RcBroker
 *   NovaRDMANoopStore               snowrdma::NoopBroker
 *   NovaMemManager                  snowrdma::MemManager
 *
 * Differences from the seed: Init takes a timeout instead of an RdmaCtrl and
 * returns whether every peer connected; a failed completion reaches the
 * callback (kind SNOWRDMA_BROKER_EVENT_KIND_FAILED) instead of aborting;
 * GetSendBuf returns nullptr when the ring is full (poll and retry) instead
 * of spinning; Post* return 0 on error (LastError() says which). Every call
 * must come from the thread that created the broker; callbacks run on it,
 * inside PollSQ / PollRQ. */
#ifndef SNOWRDMA_BROKER_HPP
#define SNOWRDMA_BROKER_HPP

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "broker.h"

namespace snowrdma {

/** Receives every completion of a broker. */
class MsgCallback {
public:
    virtual ~MsgCallback() = default;

    /** The seed's callback: what completed, its id, the peer, the received
     * bytes (receives) and the immediate. Return value unused (the seed's
     * callers ignore it too). */
    virtual bool ProcessRDMAWC(snowrdma_broker_event_kind type, uint64_t wr_id,
                               int remote_server_id, const char *buf,
                               uint32_t imm_data) = 0;

    /** The whole event (length, status, whether there is an immediate);
     * by default hands it to ProcessRDMAWC. */
    virtual void OnEvent(const snowrdma_broker_event &ev) {
        ProcessRDMAWC(ev.kind, ev.wr_id, static_cast<int>(ev.peer), ev.buf, ev.imm);
    }
};

/** Prints every completion, as the seed's DummyNovaMsgCallback. */
class DummyMsgCallback : public MsgCallback {
public:
    bool ProcessRDMAWC(snowrdma_broker_event_kind type, uint64_t wr_id,
                       int remote_server_id, const char *buf,
                       uint32_t imm_data) override {
        std::printf("t:%d wr:%llu remote:%d buf:%c imm:%u\n", static_cast<int>(type),
                    static_cast<unsigned long long>(wr_id), remote_server_id,
                    buf ? buf[0] : '-', imm_data);
        return true;
    }
};

/** The seed's broker interface. */
class RdmaBroker {
public:
    virtual ~RdmaBroker() = default;
    virtual bool Init(uint32_t timeout_ms) = 0;
    virtual uint64_t PostRead(char *localbuf, uint32_t size, int server_id,
                              uint64_t local_offset, uint64_t remote_addr,
                              bool is_offset) = 0;
    virtual uint64_t PostSend(const char *localbuf, uint32_t size, int server_id,
                              uint32_t imm_data) = 0;
    virtual uint64_t PostWrite(const char *localbuf, uint32_t size, int server_id,
                               uint64_t remote_offset, bool is_remote_offset,
                               uint32_t imm_data) = 0;
    virtual void FlushPendingSends() = 0;
    virtual void FlushPendingSends(int server_id) = 0;
    virtual uint32_t PollSQ(int server_id) = 0;
    virtual uint32_t PollSQ() = 0;
    virtual uint32_t PollRQ() = 0;
    virtual uint32_t PollRQ(int server_id) = 0;
    virtual char *GetSendBuf(int server_id) = 0;
    virtual uint32_t thread_id() = 0;
};

/** A broker that does nothing, for configurations without peers. */
class NoopBroker : public RdmaBroker {
public:
    bool Init(uint32_t) override { return true; }
    uint64_t PostRead(char *, uint32_t, int, uint64_t, uint64_t, bool) override { return 0; }
    uint64_t PostSend(const char *, uint32_t, int, uint32_t) override { return 0; }
    uint64_t PostWrite(const char *, uint32_t, int, uint64_t, bool, uint32_t) override { return 0; }
    void FlushPendingSends() override {}
    void FlushPendingSends(int) override {}
    uint32_t PollSQ(int) override { return 0; }
    uint32_t PollSQ() override { return 0; }
    uint32_t PollRQ() override { return 0; }
    uint32_t PollRQ(int) override { return 0; }
    char *GetSendBuf(int) override { return nullptr; }
    uint32_t thread_id() override { return 0; }
};

/** The RC broker: one per thread; owns its C handle (RAII, move-only). */
class RcBroker : public RdmaBroker {
public:
    /** Throws std::runtime_error when the configuration is refused. */
    RcBroker(const snowrdma_broker_config &config, MsgCallback *callback)
        : callback_(callback), thread_id_(config.thread_id) {
        if (callback_ == nullptr) throw std::runtime_error("snowrdma::RcBroker: no callback");
        handle_ = snowrdma_broker_create(&config, &RcBroker::trampoline, callback_);
        if (handle_ == nullptr)
            throw std::runtime_error("snowrdma::RcBroker: bad configuration (SNOWRDMA_LOG=warn says why)");
    }
    ~RcBroker() override {
        if (handle_ != nullptr) snowrdma_broker_destroy(handle_);
    }
    RcBroker(const RcBroker &) = delete;
    RcBroker &operator=(const RcBroker &) = delete;
    RcBroker(RcBroker &&o) noexcept
        : handle_(o.handle_), callback_(o.callback_), thread_id_(o.thread_id_), last_(o.last_) {
        o.handle_ = nullptr;
    }

    bool Init(uint32_t timeout_ms) override {
        return ok(snowrdma_broker_init(handle_, timeout_ms));
    }
    char *GetSendBuf(int server_id) override {
        char *b = snowrdma_broker_send_buf(handle_, static_cast<uint32_t>(server_id));
        if (b == nullptr) last_ = SNOWRDMA_BROKER_AGAIN;
        return b;
    }
    uint64_t PostSend(const char *localbuf, uint32_t size, int server_id,
                      uint32_t imm_data) override {
        uint64_t id = 0;
        ok(snowrdma_broker_post_send(handle_, localbuf, size, static_cast<uint32_t>(server_id),
                                     imm_data, &id));
        return id;
    }
    uint64_t PostWrite(const char *localbuf, uint32_t size, int server_id, uint64_t remote_offset,
                       bool is_remote_offset, uint32_t imm_data) override {
        uint64_t id = 0;
        ok(snowrdma_broker_post_write(handle_, localbuf, size, static_cast<uint32_t>(server_id),
                                      remote_offset, is_remote_offset, imm_data, &id));
        return id;
    }
    /** Reads into localbuf + local_offset, as the seed does. */
    uint64_t PostRead(char *localbuf, uint32_t size, int server_id, uint64_t local_offset,
                      uint64_t remote_addr, bool is_offset) override {
        uint64_t id = 0;
        ok(snowrdma_broker_post_read(handle_, localbuf + local_offset, size,
                                     static_cast<uint32_t>(server_id), remote_addr, is_offset, &id));
        return id;
    }
    void FlushPendingSends() override { ok(snowrdma_broker_flush(handle_, -1)); }
    void FlushPendingSends(int server_id) override { ok(snowrdma_broker_flush(handle_, server_id)); }
    uint32_t PollSQ(int server_id) override { return polled(snowrdma_broker_poll_sq(handle_, server_id)); }
    uint32_t PollSQ() override { return polled(snowrdma_broker_poll_sq(handle_, -1)); }
    uint32_t PollRQ(int server_id) override { return polled(snowrdma_broker_poll_rq(handle_, server_id)); }
    uint32_t PollRQ() override { return polled(snowrdma_broker_poll_rq(handle_, -1)); }
    uint32_t thread_id() override { return thread_id_; }

    /** The data region peers READ and WRITE. */
    char *Data(uint64_t *len = nullptr) { return snowrdma_broker_data(handle_, len); }
    snowrdma_broker_stats Stats() {
        snowrdma_broker_stats s{};
        ok(snowrdma_broker_get_stats(handle_, &s));
        return s;
    }
    /** The status of the last call that failed (SNOWRDMA_BROKER_OK if none). */
    int LastError() const { return last_; }
    const char *LastErrorString() const { return snowrdma_broker_strerror(last_); }
    snowrdma_broker *handle() { return handle_; }

private:
    static void trampoline(void *user, snowrdma_broker *, const snowrdma_broker_event *ev) {
        static_cast<MsgCallback *>(user)->OnEvent(*ev);
    }
    bool ok(int status) {
        if (status != SNOWRDMA_BROKER_OK) last_ = status;
        return status == SNOWRDMA_BROKER_OK;
    }
    uint32_t polled(int64_t n) {
        if (n < 0) {
            last_ = static_cast<int>(-n);
            return 0;
        }
        return static_cast<uint32_t>(n);
    }

    snowrdma_broker *handle_ = nullptr;
    MsgCallback *callback_;
    uint32_t thread_id_;
    int last_ = SNOWRDMA_BROKER_OK;
};

/** The seed's slab memory manager: partitions chosen by key % partitions,
 * 64 size classes from 1,200 bytes doubling. Exhaustion is nullptr. */
class MemManager {
public:
    /** Manages pool_bytes at buf in slabs of slab_mb MiB. Throws
     * std::runtime_error for arguments no slab fits. */
    MemManager(char *buf, uint32_t partitions, uint64_t pool_bytes, uint64_t slab_mb)
        : handle_(snowrdma_mem_manager_create(buf, pool_bytes, partitions, slab_mb << 20)) {
        if (handle_ == nullptr) throw std::runtime_error("snowrdma::MemManager: bad arguments");
    }
    ~MemManager() { snowrdma_mem_manager_destroy(handle_); }
    MemManager(const MemManager &) = delete;
    MemManager &operator=(const MemManager &) = delete;

    /** The class for `size` bytes; UINT32_MAX when none holds it. */
    uint32_t slabclassid(uint64_t key, uint64_t size) {
        int32_t c = snowrdma_mem_manager_class(handle_, key, size);
        return c < 0 ? UINT32_MAX : static_cast<uint32_t>(c);
    }
    char *ItemAlloc(uint64_t key, uint32_t scid) { return snowrdma_mem_manager_alloc(handle_, key, scid); }
    /** False when buf is not a live item of that class (a double free included). */
    bool FreeItem(uint64_t key, char *buf, uint32_t scid) {
        return snowrdma_mem_manager_free(handle_, key, buf, scid) == 0;
    }

private:
    snowrdma_mem_manager *handle_;
};

}  // namespace snowrdma

#endif  // SNOWRDMA_BROKER_HPP
