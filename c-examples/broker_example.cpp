// The RC message broker from C++ (snowrdma/broker.hpp), after the seed's
// example program: server 0 sends the one byte 'a' with immediate 1 to
// every other server, which answers with 'b' and immediate 2 from inside its
// callback; then server 0 WRITEs its name into each peer's data region by
// offset, READs it back by address, and says it is done ('z', immediate 3). Same flags as broker_example.c
// (--servers, --server_id, --rdma_port, --rdma_max_msg_size,
// --rdma_max_num_sends, --rdma_doorbell_batch_size, --mem_pool_size_mb,
// --mode=cm|socket).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <snowrdma/broker.hpp>

namespace {

std::string flag(int argc, char **argv, const std::string &name, const std::string &dflt) {
    const std::string prefix = "--" + name + "=";
    for (int i = 1; i < argc; i++)
        if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) return argv[i] + prefix.size();
    return dflt;
}

// Counts what arrives; server 1.. answer from inside the callback.
class Callback : public snowrdma::MsgCallback {
public:
    snowrdma::RcBroker *broker = nullptr;
    int replies = 0, pings = 0, dones = 0, writes = 0, reads = 0, failures = 0;

    bool ProcessRDMAWC(snowrdma_broker_event_kind type, uint64_t wr_id, int remote_server_id,
                       const char *buf, uint32_t imm_data) override {
        switch (type) {
        case SNOWRDMA_BROKER_EVENT_KIND_RECV:
            std::printf("t:RECV wr:%llu remote:%d buf:%c imm:%u\n",
                        static_cast<unsigned long long>(wr_id), remote_server_id, buf ? buf[0] : '-',
                        imm_data);
            if (imm_data == 1 && buf && buf[0] == 'a') {
                pings++;
                char *reply = broker->GetSendBuf(remote_server_id);
                if (reply == nullptr) { failures++; break; }
                reply[0] = 'b';
                broker->PostSend(reply, 1, remote_server_id, 2);
            } else if (imm_data == 2 && buf && buf[0] == 'b') {
                replies++;
            } else if (imm_data == 3 && buf && buf[0] == 'z') {
                dones++;
            } else {
                failures++;
            }
            break;
        case SNOWRDMA_BROKER_EVENT_KIND_WRITE_DONE: writes++; break;
        case SNOWRDMA_BROKER_EVENT_KIND_READ_DONE: reads++; break;
        case SNOWRDMA_BROKER_EVENT_KIND_SEND_DONE: break;
        default: failures++;
        }
        return true;
    }
};

}  // namespace

int main(int argc, char **argv) {
    const std::string servers = flag(argc, argv, "servers", "");
    const long server_id = std::stol(flag(argc, argv, "server_id", "-1"));
    if (server_id < 0) return 0;
    std::string hosts = servers;
    if (const std::string port = flag(argc, argv, "rdma_port", ""); !port.empty()) {
        hosts.clear();
        size_t start = 0;
        while (start <= servers.size()) {
            size_t end = servers.find(',', start);
            if (end == std::string::npos) end = servers.size();
            std::string h = servers.substr(start, end - start);
            hosts += (hosts.empty() ? "" : ",") + h.substr(0, h.rfind(':')) + ":" + port;
            start = end + 1;
        }
    }
    const int nservers = 1 + static_cast<int>(std::count(hosts.begin(), hosts.end(), ','));
    const uint64_t pool = std::stoull(flag(argc, argv, "mem_pool_size_mb", "1")) << 20;
    std::vector<char> backing(pool);

    snowrdma::MemManager mem(backing.data(), 1, pool, pool >> 21 ? pool >> 21 : 1);
    const uint32_t scid = mem.slabclassid(0, 40);
    char *item = mem.ItemAlloc(0, scid);
    const bool mem_ok = item != nullptr && mem.FreeItem(0, item, scid) && !mem.FreeItem(0, item, scid);

    snowrdma_broker_config cfg{};
    cfg.hosts = hosts.c_str();
    cfg.server_id = static_cast<uint32_t>(server_id);
    cfg.thread_id = 0;
    cfg.slots_per_peer = static_cast<uint32_t>(std::stoul(flag(argc, argv, "rdma_max_num_sends", "32")));
    cfg.slot_size = static_cast<uint32_t>(std::stoul(flag(argc, argv, "rdma_max_msg_size", "256")));
    cfg.doorbell_batch = static_cast<uint32_t>(std::stoul(flag(argc, argv, "rdma_doorbell_batch_size", "8")));
    cfg.memory = backing.data();
    cfg.memory_len = pool;
    cfg.mode = flag(argc, argv, "mode", "cm") == "socket" ? SNOWRDMA_BROKER_SOCKET : SNOWRDMA_BROKER_CM;

    Callback cb;
    snowrdma::RcBroker broker(cfg, &cb);
    cb.broker = &broker;
    if (!broker.Init(60000)) {
        std::fprintf(stderr, "Init: %s\n", broker.LastErrorString());
        return 1;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    auto poll_until = [&](auto done) {
        while (!done() && cb.failures == 0 && std::chrono::steady_clock::now() < deadline) {
            broker.PollRQ();
            broker.PollSQ();
        }
        return done();
    };
    bool ok = mem_ok;
    if (server_id == 0) {
        for (int s = 1; s < nservers; s++) {
            char *sendbuf = broker.GetSendBuf(s);
            sendbuf[0] = 'a';
            uint64_t wr_id = broker.PostSend(sendbuf, 1, s, 1);
            std::printf("send one byte 'a' wr:%llu imm:1\n", static_cast<unsigned long long>(wr_id));
        }
        broker.FlushPendingSends();
        ok &= poll_until([&] { return cb.replies == nservers - 1; });
        // WRITE by offset from the data region, READ back by address.
        const char name[] = "server 0";
        std::memcpy(backing.data(), name, sizeof name);
        for (int s = 1; s < nservers; s++) broker.PostWrite(backing.data(), sizeof name, s, 4096, true, 0);
        broker.FlushPendingSends();
        ok &= poll_until([&] { return cb.writes == nservers - 1; });
        for (int s = 1; s < nservers; s++) {
            uint64_t addr = 0, len = 0;
            snowrdma_broker_peer_region(broker.handle(), static_cast<uint32_t>(s), &addr, &len);
            broker.PostRead(backing.data(), sizeof name, s, 8192 + 16 * s, addr + 4096, false);
        }
        broker.FlushPendingSends();
        ok &= poll_until([&] { return cb.reads == nservers - 1; });
        for (int s = 1; s < nservers; s++) ok &= std::memcmp(backing.data() + 8192 + 16 * s, name, sizeof name) == 0;
        // Tell the others we are done.
        for (int s = 1; s < nservers; s++) {
            char *b = broker.GetSendBuf(s);
            b[0] = 'z';
            broker.PostSend(b, 1, s, 3);
        }
        broker.FlushPendingSends();
        broker.PollSQ();
    } else {
        ok &= poll_until([&] { return cb.pings == 1; });
        ok &= poll_until([&] { return cb.dones == 1; });
        ok &= std::memcmp(backing.data() + 4096, "server 0", 9) == 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ok &= cb.failures == 0;
    const snowrdma_broker_stats st = broker.Stats();
    std::printf("sends %llu recvs %llu doorbells %llu\n%s\n", static_cast<unsigned long long>(st.sends),
                static_cast<unsigned long long>(st.recvs), static_cast<unsigned long long>(st.doorbells),
                ok ? "all exchanged" : "FAILED");
    return ok ? 0 : 1;
}
