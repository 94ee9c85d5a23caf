/* Client of echo_server: over each connection it streams messages of random
 * sizes and checks every echoed byte, measures the round trip of 64-byte
 * messages, then exercises WRITE, READ (sync and async) and WRITE WITH IMM.
 * Prints throughput and latency; exits 0 only when everything matched.
 *
 *   client <ip> <port> [-b bytes per connection] [-m largest message]
 *          [-c connections] [-l round trips] */
#include <rdma.h>

#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CONNS 64
#define WINDOW (8u << 20) /* bytes in flight per connection */
#define WAIT_SECONDS 120

struct peer {
    int id;
    RdmaConn *conn;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t received;   /* echoed bytes checked so far */
    uint64_t mismatches;
    int disconnected;
    int latency_phase;
    uint64_t pongs;
    uint32_t imm;
    char imm_data[16];
    int imm_seen;
    size_t reads_done, writes_done;
    int failed;
    double half_rtt_p50_us, half_rtt_p99_us, mb_per_s;
};

static struct peer peers[MAX_CONNS];
static int nconns = 1;
static uint64_t total = 64u << 20;
static size_t max_msg = 256u << 10;
static int round_trips = 1000;
static const char *server_ip;
static int server_port;

static uint8_t pattern(int id, uint64_t i)
{
    return (uint8_t)(i ^ (i >> 8) ^ (i >> 19) ^ (uint64_t)(id * 37));
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static struct peer *find(RdmaConn *conn)
{
    for (int i = 0; i < nconns; i++)
        if (peers[i].conn == conn)
            return &peers[i];
    return NULL;
}

static void on_recv(RdmaConn *conn, void *data, size_t len)
{
    struct peer *p = find(conn);
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    if (p->latency_phase) {
        p->pongs++;
    } else {
        const uint8_t *b = data;
        for (size_t k = 0; k < len; k++)
            if (b[k] != pattern(p->id, p->received + k))
                p->mismatches++;
        p->received += len;
    }
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_recv_imm(RdmaConn *conn, uint32_t imm, void *data, size_t len)
{
    struct peer *p = find(conn);
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->imm = imm;
    memcpy(p->imm_data, data, len < sizeof p->imm_data ? len : sizeof p->imm_data - 1);
    p->imm_seen++;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_read(RdmaConn *conn, size_t len)
{
    struct peer *p = find(conn);
    pthread_mutex_lock(&p->mu);
    p->reads_done += len;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_write(RdmaConn *conn, size_t len)
{
    struct peer *p = find(conn);
    pthread_mutex_lock(&p->mu);
    p->writes_done += len;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_disconnect(RdmaConn *conn)
{
    struct peer *p = find(conn);
    fprintf(stderr, "connection %d: the server went away\n", p ? p->id : -1);
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->disconnected = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

/* Waits (bounded) until *field reaches want; the lock is held by the caller. */
static int wait_for(struct peer *p, const volatile uint64_t *counter, uint64_t want)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += WAIT_SECONDS;
    while (*counter < want && !p->disconnected)
        if (pthread_cond_timedwait(&p->cv, &p->mu, &deadline) != 0)
            return -1;
    return *counter >= want ? 0 : -1;
}

static int fail(struct peer *p, const char *what)
{
    fprintf(stderr, "connection %d: FAIL: %s\n", p->id, what);
    p->failed = 1;
    return -1;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int stream(struct peer *p)
{
    uint8_t *msg = malloc(max_msg);
    uint64_t sent = 0;
    unsigned seed = 12345u + (unsigned)p->id;
    double t0 = now_s();
    while (sent < total) {
        size_t len = 1 + (size_t)rand_r(&seed) % max_msg;
        if (len > total - sent)
            len = (size_t)(total - sent);
        for (size_t k = 0; k < len; k++)
            msg[k] = pattern(p->id, sent + k);
        pthread_mutex_lock(&p->mu);
        int ok = sent < WINDOW ? 0 : wait_for(p, &p->received, sent - WINDOW);
        int gone = p->disconnected;
        pthread_mutex_unlock(&p->mu);
        if (ok != 0 || gone) {
            free(msg);
            return fail(p, gone ? "disconnected while streaming" : "echo stalled");
        }
        size_t r;
        while ((r = rdmaConnSend(p->conn, msg, len)) == 0) {
            struct timespec pause = {0, 20000};
            nanosleep(&pause, NULL); /* ring full: the echo returns room */
        }
        if (r != len) {
            free(msg);
            /* An ended connection fails the send at once; its disconnect
             * callback follows on a runtime thread. */
            pthread_mutex_lock(&p->mu);
            struct timespec deadline;
            clock_gettime(CLOCK_REALTIME, &deadline);
            deadline.tv_sec += 10;
            while (!p->disconnected && pthread_cond_timedwait(&p->cv, &p->mu, &deadline) == 0)
                ;
            int gone = p->disconnected;
            pthread_mutex_unlock(&p->mu);
            return fail(p, gone ? "disconnected while streaming" : "rdmaConnSend failed");
        }
        sent += len;
    }
    free(msg);
    pthread_mutex_lock(&p->mu);
    int ok = wait_for(p, &p->received, total);
    uint64_t bad = p->mismatches;
    pthread_mutex_unlock(&p->mu);
    double dt = now_s() - t0;
    p->mb_per_s = (double)total / dt / 1e6;
    if (ok != 0)
        return fail(p, "not every byte came back");
    if (bad != 0)
        return fail(p, "echoed bytes differ from what was sent");
    return 0;
}

static int latency(struct peer *p)
{
    char msg[64];
    memset(msg, 'p', sizeof msg);
    double *rtt = calloc((size_t)round_trips, sizeof *rtt);
    pthread_mutex_lock(&p->mu);
    p->latency_phase = 1;
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < round_trips; i++) {
        double t = now_s();
        if (rdmaConnSend(p->conn, msg, sizeof msg) != sizeof msg) {
            free(rtt);
            return fail(p, "rdmaConnSend (latency)");
        }
        pthread_mutex_lock(&p->mu);
        int ok = wait_for(p, &p->pongs, (uint64_t)i + 1);
        pthread_mutex_unlock(&p->mu);
        if (ok != 0) {
            free(rtt);
            return fail(p, "no echo (latency)");
        }
        rtt[i] = now_s() - t;
    }
    qsort(rtt, (size_t)round_trips, sizeof *rtt, cmp_double);
    p->half_rtt_p50_us = rtt[round_trips / 2] / 2 * 1e6;
    p->half_rtt_p99_us = rtt[round_trips * 99 / 100] / 2 * 1e6;
    free(rtt);
    pthread_mutex_lock(&p->mu);
    p->latency_phase = 0;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

static int one_sided(struct peer *p)
{
    const size_t n = 65536;
    struct ibv_mr *mr = rdmaConnRegMem(p->conn, 2 * n);
    if (!mr)
        return fail(p, "rdmaConnRegMem");
    uint8_t *buf = mr->addr;
    for (size_t k = 0; k < n; k++)
        buf[k] = (uint8_t)(k * 7 + (size_t)p->id);
    uint64_t remote = (uint64_t)(uintptr_t)p->conn->tx_addr;
    uint32_t rkey = p->conn->tx_key;
    int rc = 0;
    if (rdmaSyncWriteSignaled(p->conn, (uint64_t)(uintptr_t)buf, mr->lkey, remote, rkey, (uint32_t)n) != (int)n)
        rc = fail(p, "rdmaSyncWriteSignaled");
    else if (rdmaSyncReadSignaled(p->conn, (uint64_t)(uintptr_t)(buf + n), mr->lkey, remote, rkey, (uint32_t)n) != (int)n)
        rc = fail(p, "rdmaSyncReadSignaled");
    else if (memcmp(buf, buf + n, n) != 0)
        rc = fail(p, "sync READ did not return what sync WRITE wrote");
    if (rc == 0) {
        memset(buf + n, 0, n);
        pthread_mutex_lock(&p->mu);
        size_t before = p->reads_done;
        pthread_mutex_unlock(&p->mu);
        if (rdmaConnRead(p->conn, buf + n, mr->lkey, p->conn->tx_addr, rkey, 4096) != 4096)
            rc = fail(p, "rdmaConnRead");
        pthread_mutex_lock(&p->mu);
        if (rc == 0 && wait_for(p, (const volatile uint64_t *)&p->reads_done, before + 4096) != 0)
            rc = fail(p, "no read callback");
        pthread_mutex_unlock(&p->mu);
        if (rc == 0 && memcmp(buf, buf + n, 4096) != 0)
            rc = fail(p, "async READ returned other bytes");
    }
    if (rc == 0) {
        pthread_mutex_lock(&p->mu);
        size_t before = p->writes_done;
        pthread_mutex_unlock(&p->mu);
        if (rdmaConnWrite(p->conn, buf, 100) != 100)
            rc = fail(p, "rdmaConnWrite");
        pthread_mutex_lock(&p->mu);
        if (rc == 0 && wait_for(p, (const volatile uint64_t *)&p->writes_done, before + 100) != 0)
            rc = fail(p, "no write callback");
        pthread_mutex_unlock(&p->mu);
    }
    if (rc == 0) {
        if (rdmaConnWriteWithImm(p->conn, 0xabcd0000u + (uint32_t)p->id, "imm!", 4) != 4)
            rc = fail(p, "rdmaConnWriteWithImm");
        pthread_mutex_lock(&p->mu);
        uint64_t seen = 0;
        struct timespec deadline;
        clock_gettime(CLOCK_REALTIME, &deadline);
        deadline.tv_sec += WAIT_SECONDS;
        while (rc == 0 && !p->imm_seen && !p->disconnected &&
               pthread_cond_timedwait(&p->cv, &p->mu, &deadline) == 0)
            ;
        seen = (uint64_t)p->imm_seen;
        if (rc == 0 && (!seen || p->imm != 0xabcd0000u + (uint32_t)p->id || strcmp(p->imm_data, "imm!") != 0))
            rc = fail(p, "the immediate did not come back with its data");
        pthread_mutex_unlock(&p->mu);
    }
    rdmaConnDeregMem(p->conn, mr);
    return rc;
}

static void *run(void *arg)
{
    struct peer *p = arg;
    if (rdmaConnect(p->conn, (char *)server_ip, server_port) != RDMA_OK) {
        fail(p, "rdmaConnect");
        return NULL;
    }
    if (stream(p) == 0 && latency(p) == 0 && one_sided(p) == 0)
        printf("connection %d: %llu bytes echoed and checked, %.1f MB/s; half round trip 64 B: "
               "median %.1f us, p99 %.1f us\n",
               p->id, (unsigned long long)total, p->mb_per_s, p->half_rtt_p50_us, p->half_rtt_p99_us);
    return NULL;
}

int main(int argc, char **argv)
{
    int c;
    while ((c = getopt(argc, argv, "b:m:c:l:")) != -1) {
        switch (c) {
        case 'b': total = strtoull(optarg, NULL, 0); break;
        case 'm': max_msg = strtoull(optarg, NULL, 0); break;
        case 'c': nconns = atoi(optarg); break;
        case 'l': round_trips = atoi(optarg); break;
        default: goto usage;
        }
    }
    if (argc - optind != 2 || nconns < 1 || nconns > MAX_CONNS || max_msg < 1 || round_trips < 1 || total < 1)
        goto usage;
    server_ip = argv[optind];
    server_port = atoi(argv[optind + 1]);

    pthread_t threads[MAX_CONNS];
    for (int i = 0; i < nconns; i++) {
        struct peer *p = &peers[i];
        p->id = i;
        pthread_mutex_init(&p->mu, NULL);
        pthread_cond_init(&p->cv, NULL);
        RdmaConnOptions opt = {0};
        opt.recv_callback = on_recv;
        opt.read_callback = on_read;
        opt.write_callback = on_write;
        p->conn = rdmaConn(&opt);
        if (!p->conn) {
            fprintf(stderr, "rdmaConn failed\n");
            return 1;
        }
        rdmaConnSetDisconnectCallback(p->conn, on_disconnect);
        rdmaConnSetRecvImmCallback(p->conn, on_recv_imm);
    }
    double t0 = now_s();
    for (int i = 0; i < nconns; i++)
        pthread_create(&threads[i], NULL, run, &peers[i]);
    int failed = 0, gone = 0;
    for (int i = 0; i < nconns; i++) {
        pthread_join(threads[i], NULL);
        failed |= peers[i].failed;
        gone |= peers[i].disconnected;
    }
    double dt = now_s() - t0;
    for (int i = 0; i < nconns; i++)
        rdmaConnClose(peers[i].conn);
    rdmaRuntimeStop();
    printf("%d connection(s), %.1f MB echoed in %.2f s: %s\n", nconns, (double)total * nconns / 1e6, dt,
           failed ? "FAILED" : "every byte matched");
    return gone ? 3 : failed ? 1 : 0;
usage:
    fprintf(stderr, "usage: %s <ip> <port> [-b bytes] [-m largest message] [-c connections] [-l round trips]\n",
            argv[0]);
    return 2;
}
