#define _POSIX_C_SOURCE 200809L
/* The RC message broker from C, after the seed's (RDMALib's) example
 * program and flags: every worker thread i of every server connects to
 * thread i of every other server, sends --messages messages to each peer
 * (the first is the seed's one byte 'a' with immediate 1), and exits once it
 * has received as many from each peer and its own sends have completed.
 *
 *   broker_example --servers=ip:port,ip:port --server_id=0
 *       [--mem_pool_size_gb=N | --mem_pool_size_mb=N] [--rdma_port=P]
 *       [--rdma_max_msg_size=N] [--rdma_max_num_sends=N]
 *       [--rdma_doorbell_batch_size=N] [--nrdma_workers=N]
 *       [--mode=cm|socket] [--messages=N]
 *
 * --rdma_port, when set, replaces the port of every host. Exit status 0
 * when every worker exchanged everything. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <snowrdma/broker.h>

static const char *servers = "";
static int64_t server_id = -1;
static uint64_t mem_pool_bytes = 1 << 20;
static uint64_t rdma_port = 0;
static uint64_t max_msg_size = 256;
static uint64_t max_num_sends = 32;
static uint64_t doorbell_batch = 8;
static uint32_t nrdma_workers = 1;
static uint32_t messages = 1;
static snowrdma_broker_mode mode = SNOWRDMA_BROKER_CM;
static uint32_t nservers;

struct worker {
    uint32_t thread_id;
    char *memory;
    char *hosts;
    uint32_t *received; /* per server */
    uint32_t sent_done;
    uint32_t failed;
    int ok;
};

static const char *kind_name(snowrdma_broker_event_kind k) {
    switch (k) {
    case SNOWRDMA_BROKER_EVENT_KIND_RECV: return "RECV";
    case SNOWRDMA_BROKER_EVENT_KIND_SEND_DONE: return "SEND";
    case SNOWRDMA_BROKER_EVENT_KIND_WRITE_DONE: return "RDMA_WRITE";
    case SNOWRDMA_BROKER_EVENT_KIND_READ_DONE: return "RDMA_READ";
    case SNOWRDMA_BROKER_EVENT_KIND_FAILED: return "FAILED";
    case SNOWRDMA_BROKER_EVENT_KIND_PEER_DOWN: return "PEER_DOWN";
    }
    return "?";
}

/* Runs on the worker's thread, inside the polls. */
static void on_event(void *user, snowrdma_broker *b, const snowrdma_broker_event *ev) {
    (void)b;
    struct worker *w = user;
    if (ev->kind == SNOWRDMA_BROKER_EVENT_KIND_RECV) {
        /* Message k carries 'a' + k % 26 and immediate k + 1. */
        uint32_t k = ev->imm - 1;
        if (!ev->has_imm || ev->len != 1 || ev->buf[0] != (char)('a' + k % 26)) {
            fprintf(stderr, "worker %u: bad message from %u\n", w->thread_id, ev->peer);
            w->failed++;
        }
        if (k == 0)
            printf("t:%s wr:%llu remote:%u buf:%c imm:%u\n", kind_name(ev->kind),
                   (unsigned long long)ev->wr_id, ev->peer, ev->buf[0], ev->imm);
        w->received[ev->peer]++;
    } else if (ev->kind == SNOWRDMA_BROKER_EVENT_KIND_SEND_DONE) {
        w->sent_done++;
    } else if (ev->kind == SNOWRDMA_BROKER_EVENT_KIND_PEER_DOWN && w->received[ev->peer] >= messages) {
        /* A peer that has sent everything may leave before we are done. */
    } else {
        fprintf(stderr, "worker %u: %s from %u (status %u)\n", w->thread_id, kind_name(ev->kind),
                ev->peer, ev->status);
        w->failed++;
    }
}

static void *run_worker(void *arg) {
    struct worker *w = arg;
    snowrdma_broker_config cfg = {
        .hosts = w->hosts,
        .server_id = (uint32_t)server_id,
        .thread_id = w->thread_id,
        .slots_per_peer = (uint32_t)max_num_sends,
        .slot_size = (uint32_t)max_msg_size,
        .doorbell_batch = (uint32_t)doorbell_batch,
        .memory = w->memory,
        .memory_len = mem_pool_bytes,
        .mode = mode,
        .device = NULL,
    };
    snowrdma_broker *b = snowrdma_broker_create(&cfg, on_event, w);
    if (b == NULL) {
        fprintf(stderr, "worker %u: snowrdma_broker_create failed\n", w->thread_id);
        return NULL;
    }
    int rc = snowrdma_broker_init(b, 60000);
    if (rc != SNOWRDMA_BROKER_OK) {
        fprintf(stderr, "worker %u: init: %s\n", w->thread_id, snowrdma_broker_strerror(rc));
        snowrdma_broker_destroy(b);
        return NULL;
    }
    uint32_t peers = nservers - 1;
    for (uint32_t k = 0; k < messages; k++) {
        for (uint32_t s = 0; s < nservers; s++) {
            if (s == server_id)
                continue;
            char *buf;
            /* A full ring is a NULL: reap completions and try again. */
            while ((buf = snowrdma_broker_send_buf(b, s)) == NULL) {
                snowrdma_broker_flush(b, (int32_t)s);
                snowrdma_broker_poll_sq(b, -1);
                snowrdma_broker_poll_rq(b, -1);
            }
            buf[0] = (char)('a' + k % 26);
            uint64_t wr_id = 0;
            rc = snowrdma_broker_post_send(b, buf, 1, s, k + 1, &wr_id);
            if (rc != SNOWRDMA_BROKER_OK) {
                fprintf(stderr, "worker %u: post_send: %s\n", w->thread_id, snowrdma_broker_strerror(rc));
                w->failed++;
            } else if (k == 0) {
                printf("send one byte 'a' wr:%llu imm:1 to %u\n", (unsigned long long)wr_id, s);
            }
        }
    }
    snowrdma_broker_flush(b, -1);
    for (;;) {
        snowrdma_broker_poll_rq(b, -1);
        snowrdma_broker_poll_sq(b, -1);
        bool all = w->sent_done == messages * peers;
        for (uint32_t s = 0; s < nservers; s++)
            if (s != server_id && w->received[s] < messages)
                all = false;
        if (all || w->failed)
            break;
    }
    /* Let the peers reap their last completions before disconnecting. */
    for (int i = 0; i < 200; i++) {
        snowrdma_broker_poll_rq(b, -1);
        snowrdma_broker_poll_sq(b, -1);
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
    }
    snowrdma_broker_stats st;
    snowrdma_broker_get_stats(b, &st);
    printf("worker %u: sends %llu recvs %llu doorbells %llu\n", w->thread_id,
           (unsigned long long)st.sends, (unsigned long long)st.recvs,
           (unsigned long long)st.doorbells);
    w->ok = w->failed == 0;
    snowrdma_broker_destroy(b);
    return NULL;
}

/* gflags style: --name=value. */
static const char *flag(const char *arg, const char *name) {
    size_t n = strlen(name);
    if (strncmp(arg, "--", 2) == 0 && strncmp(arg + 2, name, n) == 0 && arg[2 + n] == '=')
        return arg + 3 + n;
    return NULL;
}

/* The hosts with --rdma_port, when set, as every host's port. */
static char *hosts_with_port(void) {
    char *out = calloc(strlen(servers) * 2 + 64, 1);
    const char *p = servers;
    nservers = 0;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        char host[256] = {0};
        if (len >= sizeof host)
            len = sizeof host - 1;
        memcpy(host, p, len);
        if (rdma_port) {
            char *colon = strrchr(host, ':');
            if (colon)
                *colon = 0;
            sprintf(out + strlen(out), "%s%s:%llu", nservers ? "," : "", host, (unsigned long long)rdma_port);
        } else {
            sprintf(out + strlen(out), "%s%s", nservers ? "," : "", host);
        }
        nservers++;
        p = end ? end + 1 : p + len;
    }
    return out;
}

int main(int argc, char **argv) {
    const char *v;
    for (int i = 1; i < argc; i++) {
        if ((v = flag(argv[i], "servers"))) servers = v;
        else if ((v = flag(argv[i], "server_id"))) server_id = strtoll(v, NULL, 10);
        else if ((v = flag(argv[i], "mem_pool_size_gb"))) mem_pool_bytes = strtoull(v, NULL, 10) << 30;
        else if ((v = flag(argv[i], "mem_pool_size_mb"))) mem_pool_bytes = strtoull(v, NULL, 10) << 20;
        else if ((v = flag(argv[i], "rdma_port"))) rdma_port = strtoull(v, NULL, 10);
        else if ((v = flag(argv[i], "rdma_max_msg_size"))) max_msg_size = strtoull(v, NULL, 10);
        else if ((v = flag(argv[i], "rdma_max_num_sends"))) max_num_sends = strtoull(v, NULL, 10);
        else if ((v = flag(argv[i], "rdma_doorbell_batch_size"))) doorbell_batch = strtoull(v, NULL, 10);
        else if ((v = flag(argv[i], "nrdma_workers"))) nrdma_workers = (uint32_t)strtoul(v, NULL, 10);
        else if ((v = flag(argv[i], "messages"))) messages = (uint32_t)strtoul(v, NULL, 10);
        else if ((v = flag(argv[i], "mode"))) mode = strcmp(v, "socket") == 0 ? SNOWRDMA_BROKER_SOCKET : SNOWRDMA_BROKER_CM;
        else {
            fprintf(stderr, "unknown flag %s\n", argv[i]);
            return 2;
        }
    }
    /* As the seed: no server id, nothing to do. */
    if (server_id == -1)
        return 0;
    printf("servers=%s\nserver_id=%lld\nmem_pool_size_bytes=%llu\nrdma_port=%llu\n"
           "rdma_max_msg_size=%llu\nrdma_max_num_sends=%llu\nrdma_doorbell_batch_size=%llu\n"
           "nrdma_workers=%u\nmessages=%u\n",
           servers, (long long)server_id, (unsigned long long)mem_pool_bytes,
           (unsigned long long)rdma_port, (unsigned long long)max_msg_size,
           (unsigned long long)max_num_sends, (unsigned long long)doorbell_batch, nrdma_workers,
           messages);
    char *hosts = hosts_with_port();
    if (nservers < 2 || server_id < 0 || server_id >= nservers || nrdma_workers == 0) {
        fprintf(stderr, "need at least two --servers, a --server_id among them and a worker\n");
        return 2;
    }

    /* The backing memory is the data region peers READ and WRITE; the memory
     * manager hands out items of it, as in the seed. */
    char *backing = calloc(nrdma_workers, mem_pool_bytes);
    snowrdma_mem_manager *mm = snowrdma_mem_manager_create(backing, mem_pool_bytes, 1, mem_pool_bytes / 2);
    if (mm == NULL) {
        fprintf(stderr, "snowrdma_mem_manager_create failed\n");
        return 1;
    }
    int32_t scid = snowrdma_mem_manager_class(mm, 0, 40);
    char *item = snowrdma_mem_manager_alloc(mm, 0, (uint32_t)scid);
    if (item == NULL || snowrdma_mem_manager_free(mm, 0, item, (uint32_t)scid) != 0 ||
        snowrdma_mem_manager_free(mm, 0, item, (uint32_t)scid) != -1) {
        fprintf(stderr, "the memory manager misbehaved\n");
        return 1;
    }
    snowrdma_mem_manager_destroy(mm);

    struct worker *workers = calloc(nrdma_workers, sizeof *workers);
    pthread_t *threads = calloc(nrdma_workers, sizeof *threads);
    for (uint32_t t = 0; t < nrdma_workers; t++) {
        workers[t].thread_id = t;
        workers[t].memory = backing + (size_t)t * mem_pool_bytes;
        workers[t].hosts = hosts;
        workers[t].received = calloc(nservers, sizeof(uint32_t));
        pthread_create(&threads[t], NULL, run_worker, &workers[t]);
    }
    int ok = 1;
    for (uint32_t t = 0; t < nrdma_workers; t++) {
        pthread_join(threads[t], NULL);
        ok &= workers[t].ok;
        free(workers[t].received);
    }
    free(workers);
    free(threads);
    free(hosts);
    free(backing);
    printf("%s\n", ok ? "all exchanged" : "FAILED");
    return ok ? 0 : 1;
}
