/* Feeds the SnowRDMA API bad input, against a running echo_server, and
 * checks that every call answers with its error code while the process and
 * the other connections carry on. Exits 0 when all behaved.
 *
 *   misuse <ip> <port of echo_server> <a port where nothing listens> */
#include <rdma.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int failures, checks;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int echoes, disconnects;

#include "check.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void on_recv(RdmaConn *conn, void *data, size_t len)
{
    (void)conn, (void)data, (void)len;
    pthread_mutex_lock(&mu);
    echoes++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void on_disconnect(RdmaConn *conn)
{
    (void)conn;
    pthread_mutex_lock(&mu);
    disconnects++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

/* Waits up to 10 s for *counter to reach want. */
static int wait_count(int *counter, int want)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 10;
    pthread_mutex_lock(&mu);
    while (*counter < want && pthread_cond_timedwait(&cv, &mu, &deadline) == 0)
        ;
    int ok = *counter >= want;
    pthread_mutex_unlock(&mu);
    return ok;
}

/* A server whose accept callback releases the server itself. */
static struct RdmaListener *self_releasing;
static atomic_int releases;

static void release_in_accept(RdmaConn *conn)
{
    (void)conn;
    atomic_fetch_add(&releases, 1);
    rdmaServerRelease(self_releasing);
}

static void *serve(void *l)
{
    rdmaServerStart(l);
    return NULL;
}

static void close_on_connect(RdmaConn *conn)
{
    rdmaConnClose(conn);
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "misuse: timed out (a call hangs)\n";
    ssize_t n = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

/* Two threads connecting one handle at once. */
static RdmaConn *shared_handle;
static char *shared_ip;
static int shared_port;
static atomic_int connected_calls;

static void count_connected(RdmaConn *conn)
{
    (void)conn;
    atomic_fetch_add(&connected_calls, 1);
}

static void *connect_shared(void *out)
{
    errno = 0;
    int rc = rdmaConnect(shared_handle, shared_ip, shared_port);
    ((int *)out)[0] = rc;
    ((int *)out)[1] = errno;
    return NULL;
}

/* An rdmaConnect on `shared_handle` that is left to time out. */
static void *connect_unanswered(void *out)
{
    errno = 0;
    int rc = rdmaConnect(shared_handle, shared_ip, *(int *)out);
    ((int *)out)[0] = rc;
    ((int *)out)[1] = errno;
    return NULL;
}

/* The data pointer of the first message a connection received. */
static void *volatile first_data;

static void keep_data(RdmaConn *conn, void *data, size_t len)
{
    if (!first_data)
        first_data = data;
    on_recv(conn, data, len);
}

/* A slow receive callback, and whether one ran on after the close of its
 * connection (on another thread) had returned. */
static atomic_int slow_entered, close_returned, after_close;

static void slow_recv(RdmaConn *conn, void *data, size_t len)
{
    (void)conn, (void)data, (void)len;
    if (!atomic_load(&close_returned)) {
        atomic_store(&slow_entered, 1);
        struct timespec slow = {0, 300 * 1000 * 1000};
        nanosleep(&slow, NULL);
    }
    if (atomic_load(&close_returned))
        atomic_fetch_add(&after_close, 1);
}

static RdmaConn *connect_to(char *ip, int port)
{
    RdmaConnOptions opt = {0};
    opt.recv_callback = on_recv;
    opt.disconnect_callback = on_disconnect;
    RdmaConn *c = rdmaConn(&opt);
    if (c && rdmaConnect(c, ip, port) != RDMA_OK) {
        rdmaConnClose(c);
        return NULL;
    }
    return c;
}

static int echo_works(RdmaConn *c)
{
    int before;
    pthread_mutex_lock(&mu);
    before = echoes;
    pthread_mutex_unlock(&mu);
    return rdmaConnSend(c, "ping", 4) == 4 && wait_count(&echoes, before + 1);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s <ip> <echo port> <closed port>\n", argv[0]);
        return 2;
    }
    char *ip = argv[1];
    int port = atoi(argv[2]), closed = atoi(argv[3]);
    char buf[64] = "data";
    const size_t err = (size_t)-1;
    signal(SIGALRM, on_alarm);
    alarm(100);

    /* Connecting where nothing listens fails, within about rdmaTimeoutms. */
    rdmaTimeoutms = 1000;
    double t = now_s();
    RdmaConn *nowhere = rdmaConn(NULL);
    CHECK(nowhere != NULL, "rdmaConn(NULL) gives a connection with default options");
    errno = 0;
    CHECK(rdmaConnect(nowhere, ip, closed) == RDMA_ERR, "connect to a closed port -> RDMA_ERR");
    int connect_errno = errno;
    printf("     (errno %d: %s)\n", connect_errno, strerror(connect_errno));
    CHECK(connect_errno == ECONNREFUSED, "... errno ECONNREFUSED");
    CHECK(now_s() - t < 5.0, "... within 5 s");
    CHECK(nowhere->state == RDMA_CONN_STATE_ERROR && nowhere->last_errno == ECONNREFUSED,
          "... and conn->state says ERROR, conn->last_errno ECONNREFUSED");
    rdmaConnClose(nowhere);
    /* A program that retries until its server is up: the handle of a failed
     * attempt connects, and carries data, once something listens. */
    RdmaConnOptions retry_opt = {0};
    retry_opt.recv_callback = on_recv;
    retry_opt.disconnect_callback = on_disconnect;
    RdmaConn *retry = rdmaConn(&retry_opt);
    CHECK(rdmaConnect(retry, ip, closed) == RDMA_ERR && errno == ECONNREFUSED,
          "a handle's first attempt, to a closed port, fails");
    CHECK(rdmaConnect(retry, ip, port) == RDMA_OK, "... and its retry on the same handle connects");
    CHECK(retry->state == RDMA_CONN_STATE_MR_READY && retry->recv_buf != NULL,
          "... with the retry's state and buffers in the struct");
    CHECK(echo_works(retry), "... and carries data");
    rdmaConnClose(retry);
    /* Closed from its own connected callback, which runs on the completion
     * thread, before or after rdmaConnect returns: a close that came first
     * is reported (nothing is left connected behind the dead handle), one
     * that came after leaves the handle dead. */
    RdmaConnOptions close_opt = {0};
    close_opt.connected_callback = close_on_connect;
    RdmaConn *closing = rdmaConn(&close_opt);
    errno = 0;
    int closing_rc = rdmaConnect(closing, ip, port);
    CHECK((closing_rc == RDMA_ERR && errno == ECONNABORTED) || closing_rc == RDMA_OK,
          "a connection closed by its connected callback -> RDMA_ERR, errno ECONNABORTED (or RDMA_OK, closed after)");
    int dead = 0;
    for (int i = 0; i < 1000 && !dead; i++) {
        dead = rdmaConnSend(closing, buf, 4) == err;
        if (!dead)
            usleep(10000);
    }
    CHECK(dead, "... and its handle is dead");
    errno = 0;
    CHECK(rdmaConnect(NULL, ip, port) == RDMA_ERR && errno == EINVAL, "rdmaConnect(NULL conn) -> RDMA_ERR, errno EINVAL");
    RdmaConn *bad_port = rdmaConn(NULL);
    errno = 0;
    CHECK(rdmaConnect(bad_port, ip, 70000) == RDMA_ERR && errno == EINVAL, "connect to port 70000 -> errno EINVAL");
    rdmaConnClose(bad_port);

    /* An options struct at an odd address, its enum and bool fields
     * holding values C allows and the enums do not: read field by field. */
    _Alignas(8) unsigned char raw[sizeof(RdmaConnOptions) + 1];
    memset(raw, 0, sizeof raw);
    int bad_enum = 7;
    memcpy(raw + 1 + offsetof(RdmaConnOptions, rdma_comm_mode), &bad_enum, sizeof bad_enum);
    raw[1 + offsetof(RdmaConnOptions, rdma_enable_phys_addr_access)] = 2;
    RdmaConn *odd = rdmaConn((const RdmaConnOptions *)(const void *)(raw + 1));
    CHECK(odd != NULL, "rdmaConn with an unaligned options struct holding bad enum values");
    rdmaConnClose(odd);

    RdmaConn *a = connect_to(ip, port);
    RdmaConn *b = connect_to(ip, port);
    CHECK(a && b, "two connections to the echo server");
    if (!a || !b)
        return 1;
    CHECK(a->state == RDMA_CONN_STATE_MR_READY && a->type == CONNECTED_CONN, "state MR_READY, type CONNECTED_CONN");
    CHECK(a->ip && strcmp(a->ip, ip) == 0 && a->port == port, "conn->ip and conn->port name the server");
    errno = 0;
    CHECK(rdmaConnect(a, ip, port) == RDMA_ERR && errno == EISCONN, "connecting a connected conn -> RDMA_ERR, errno EISCONN");

    CHECK(rdmaConnSend(NULL, buf, 4) == err, "send on NULL -> (size_t)-1");
    CHECK(rdmaConnSend(a, NULL, 4) == err, "send of NULL data -> (size_t)-1");
    CHECK(rdmaConnSend(a, buf, 0) == err, "send of 0 bytes -> (size_t)-1");
    size_t huge = (size_t)a->tx_length + 1;
    char *big = calloc(1, huge);
    CHECK(rdmaConnSend(a, big, huge) == err, "message larger than the peer's ring -> (size_t)-1");
    free(big);
    CHECK(rdmaConnWrite(a, NULL, 4) == err, "write of NULL data -> (size_t)-1");
    CHECK(rdmaConnSend(a, buf, SIZE_MAX) == err, "send of SIZE_MAX bytes -> (size_t)-1");
    CHECK(rdmaConnWrite(a, buf, SIZE_MAX) == err, "write of SIZE_MAX bytes -> (size_t)-1");
    CHECK(rdmaConnSendWithImm(a, 1, buf, SIZE_MAX) == err, "send with imm of SIZE_MAX bytes -> (size_t)-1");
    CHECK(rdmaConnWriteWithImm(a, 1, buf, SIZE_MAX) == RDMA_ERR, "write with imm of SIZE_MAX bytes -> RDMA_ERR");
    CHECK(rdmaConnReadBuf(a, buf, SIZE_MAX) == RDMA_ERR, "read of SIZE_MAX bytes -> RDMA_ERR");
    CHECK(rdmaConnWriteWithImm(a, 1, buf, 0) == RDMA_ERR, "write with imm of 0 bytes -> RDMA_ERR");
    CHECK(rdmaConnSend((RdmaConn *)buf, buf, 4) == err, "send on a foreign pointer -> (size_t)-1");
    CHECK(rdmaConnSetRecvCallback((RdmaConn *)buf, on_recv) == RDMA_ERR, "set callback on a foreign pointer -> RDMA_ERR");
    CHECK(rdmaConnRegMem(NULL, 64) == NULL, "rdmaConnRegMem(NULL) -> NULL");
    CHECK(rdmaServerStart(NULL) == RDMA_ERR, "rdmaServerStart(NULL) -> RDMA_ERR");
    CHECK(rdmaServer(NULL, ip, port, NULL) == RDMA_ERR, "rdmaServer(NULL listener) -> RDMA_ERR");

    struct ibv_mr *mr = rdmaConnRegMem(a, 4096);
    CHECK(mr != NULL, "rdmaConnRegMem");
    uint64_t local = (uint64_t)(uintptr_t)mr->addr, remote = (uint64_t)(uintptr_t)a->tx_addr;
    CHECK(rdmaSyncReadSignaled(a, local, mr->lkey ^ 0x5a5a, remote, a->tx_key, 64) == RDMA_ERR,
          "sync read into an unregistered lkey -> RDMA_ERR");
    CHECK(rdmaSyncReadSignaled(a, local + 4000, mr->lkey, remote, a->tx_key, 4096) == RDMA_ERR,
          "sync read past the end of the local buffer -> RDMA_ERR");
    CHECK(rdmaSyncReadSignaled(a, UINT64_MAX - 15, mr->lkey, remote, a->tx_key, 64) == RDMA_ERR,
          "sync read into a range past the end of the address space -> RDMA_ERR");
    CHECK(rdmaSyncReadSignaled(a, local, mr->lkey, remote, a->tx_key, 0) == RDMA_ERR, "sync read of 0 bytes -> RDMA_ERR");
    CHECK(rdmaPAReadSignaled(a, local, mr->lkey, remote, 64) == RDMA_ERR, "PA read without PA support -> RDMA_ERR");
    CHECK(rdmaPASyncWriteSignaled(a, local, mr->lkey, remote, 64) == RDMA_ERR, "PA sync write -> RDMA_ERR");
    CHECK(echo_works(a), "the connection still echoes after refused calls");

    /* A wrong rkey fails the operation and, as RDMA does, the connection. */
    CHECK(rdmaSyncReadSignaled(a, local, mr->lkey, remote, a->tx_key ^ 0x77, 64) == RDMA_ERR,
          "sync read with a wrong rkey -> RDMA_ERR");
    CHECK(a->state == RDMA_CONN_STATE_ERROR, "... with the state ERROR when it returns");
    CHECK(wait_count(&disconnects, 1), "... and the disconnect callback fires");
    CHECK(rdmaConnSend(a, buf, 4) == err, "send on the failed connection -> (size_t)-1");
    CHECK(echo_works(b), "the other connection is intact");

    rdmaConnClose(a);
    CHECK(rdmaConnSend(a, buf, 4) == err, "send after close -> (size_t)-1");
    rdmaConnClose(a); /* double close: refused, harmless */
    CHECK(echo_works(b), "the other connection is still intact after the double close");
    RdmaConn *c = connect_to(ip, port);
    CHECK(c && echo_works(c), "a new connection works");

    /* Two threads connect one handle at once: one connection wins it, the
     * other is closed (not left running behind the handle). */
    RdmaConnOptions copt = {0};
    copt.recv_callback = on_recv;
    copt.connected_callback = count_connected;
    shared_handle = rdmaConn(&copt);
    shared_ip = ip;
    shared_port = port;
    int results[2][2];
    pthread_t racers[2];
    for (int i = 0; i < 2; i++)
        pthread_create(&racers[i], NULL, connect_shared, results[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(racers[i], NULL);
    int oks = (results[0][0] == RDMA_OK) + (results[1][0] == RDMA_OK);
    int isconn = (results[0][0] == RDMA_ERR && results[0][1] == EISCONN) +
                 (results[1][0] == RDMA_ERR && results[1][1] == EISCONN);
    CHECK(oks == 1 && isconn == 1, "two rdmaConnect on one handle at once: one RDMA_OK, one EISCONN");
    CHECK(echo_works(shared_handle), "... and the handle echoes");
    CHECK(atomic_load(&connected_calls) == 1, "... and connected_callback fired once");
    rdmaConnClose(shared_handle);

    /* The same, where the attempt that fails ends last: it leaves the
     * other's connection bound, and the state it reads. A listener never
     * started answers no connect request, so one to it times out. */
    RdmaListener *unanswering = NULL;
    CHECK(rdmaServer(&unanswering, ip, closed, NULL) == RDMA_OK, "a listener that is never started");
    shared_handle = rdmaConn(&copt);
    int late[2] = {closed, 0};
    pthread_t late_racer;
    pthread_create(&late_racer, NULL, connect_unanswered, late);
    struct timespec settle = {0, 200 * 1000 * 1000};
    nanosleep(&settle, NULL);
    CHECK(rdmaConnect(shared_handle, ip, port) == RDMA_OK, "rdmaConnect while another waits on the handle");
    pthread_join(late_racer, NULL);
    CHECK(late[0] == RDMA_ERR, "... the unanswered one fails");
    CHECK(shared_handle->state == RDMA_CONN_STATE_MR_READY && echo_works(shared_handle),
          "... and the handle stays connected (MR_READY) and echoes");
    rdmaConnClose(shared_handle);
    rdmaServerRelease(unanswering);

    /* A program that kept a receive callback's data pointer reads memory
     * a later message overwrote, never memory given back, even after a
     * larger message (under ASan, a read of freed memory fails). */
    RdmaConnOptions keep_opt = {0};
    keep_opt.recv_callback = keep_data;
    RdmaConn *keeper = rdmaConn(&keep_opt);
    CHECK(rdmaConnect(keeper, ip, port) == RDMA_OK && echo_works(keeper), "a 4-byte echo");
    static char large[64 * 1024];
    memset(large, 'x', sizeof large);
    pthread_mutex_lock(&mu);
    int echoed = echoes;
    pthread_mutex_unlock(&mu);
    CHECK(rdmaConnSend(keeper, large, sizeof large) == sizeof large && wait_count(&echoes, echoed + 1),
          "... then a 64 KiB echo");
    CHECK(first_data && ((volatile char *)first_data)[0] == 'x',
          "... and the first message's kept pointer reads the later message");
    rdmaConnClose(keeper);

    /* A close while a receive callback runs on snowrdma-cq returns after
     * it, and no callback starts after the close: a program may then free
     * what its callbacks use. Two echoes come: the second is delivered
     * after the first callback, unless the close came between. */
    RdmaConnOptions slow_opt = {0};
    slow_opt.recv_callback = slow_recv;
    RdmaConn *slow = rdmaConn(&slow_opt);
    CHECK(rdmaConnect(slow, ip, port) == RDMA_OK, "a connection whose receive callback is slow");
    CHECK(rdmaConnSend(slow, "ping", 4) == 4 && rdmaConnSend(slow, "pong", 4) == 4, "... two messages sent");
    struct timespec ms = {0, 1000 * 1000};
    for (int i = 0; i < 5000 && !atomic_load(&slow_entered); i++)
        nanosleep(&ms, NULL);
    CHECK(atomic_load(&slow_entered), "... its receive callback runs");
    rdmaConnClose(slow);
    atomic_store(&close_returned, 1);
    struct timespec linger = {0, 500 * 1000 * 1000};
    nanosleep(&linger, NULL);
    CHECK(atomic_load(&after_close) == 0, "... rdmaConnClose returned after it, and no callback ran after the close");

    /* A server released inside its own accept callback: the peer is
     * refused, rdmaServerStart returns, and the runtime carries on. */
    RdmaServerOptions sopt = {0};
    sopt.accept_callback = release_in_accept;
    CHECK(rdmaServer(&self_releasing, ip, closed, &sopt) == RDMA_OK, "a server on the closed port");
    pthread_t server_thread;
    pthread_create(&server_thread, NULL, serve, self_releasing);
    RdmaConn *refused = rdmaConn(NULL);
    errno = 0;
    CHECK(rdmaConnect(refused, ip, closed) == RDMA_ERR && errno == ECONNREFUSED,
          "the server released in its accept callback refuses the peer (ECONNREFUSED)");
    rdmaConnClose(refused);
    pthread_join(server_thread, NULL);
    CHECK(atomic_load(&releases) == 1, "... and rdmaServerStart returned");
    RdmaConn *again = rdmaConn(NULL);
    errno = 0;
    CHECK(rdmaConnect(again, ip, closed) == RDMA_ERR && errno == ECONNREFUSED && atomic_load(&releases) == 1,
          "... and nothing listens there any more");
    rdmaConnClose(again);
    CHECK(c && echo_works(c), "the runtime carries on after the release");
    rdmaConnClose(b);
    if (c)
        rdmaConnClose(c);
    rdmaRuntimeStop();
    printf("misuse: %d of %d checks behaved\n", checks - failures, checks);
    return failures ? 1 : 0;
}
