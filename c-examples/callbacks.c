/* Callbacks that call back: from inside every kind of callback, on both
 * sides of a connection in this process, calls every callback setter and
 * every export that sends or moves data. None may deadlock or crash: an
 * alarm ends the program (non-zero) if anything hangs.
 *
 *   callbacks <ip> <port>
 *
 * Exits 0 when every callback kind ran its calls on both sides. */
#include <rdma.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum kind { ACCEPT, CONNECTED, RECV, RECV_IMM, WRITE, READ, DISCONNECT, KINDS };
static const char *kind_names[KINDS] = {"accept", "connected", "recv", "recv-imm", "write", "read", "disconnect"};
enum side { SERVER, CLIENT, SIDES };

static atomic_int entered[SIDES][KINDS], done[SIDES][KINDS];
static RdmaListener *listener;
static RdmaConn *accepted[2];
static atomic_int n_accepted;
/* The connection the accept callback closed: no other callback may see it. */
static RdmaConn *volatile refused_here;
static atomic_int refused_called;

static void on_recv(RdmaConn *conn, void *data, size_t len);
static void on_recv_imm(RdmaConn *conn, uint32_t imm, void *data, size_t len);
static void on_write(RdmaConn *conn, size_t len);
static void on_read(RdmaConn *conn, size_t len);
static void on_connected(RdmaConn *conn);
static void on_disconnect(RdmaConn *conn);
static void on_accept(RdmaConn *conn);

/* The first time a kind of callback runs on a side: every setter (setting
 * the callbacks in force again), then every send and one-sided operation.
 * Their results do not matter here (some cannot succeed in some
 * callbacks, e.g. before the connection is up or after it ended); that
 * they return does. */
static void call_everything(RdmaConn *conn, enum kind k)
{
    enum side s = conn->type == ACCEPTED_CONN ? SERVER : CLIENT;
    if (conn == refused_here)
        atomic_store(&refused_called, 1);
    if (atomic_exchange(&entered[s][k], 1))
        return;
    rdmaConnSetRecvCallback(conn, on_recv);
    rdmaConnSetRecvImmCallback(conn, on_recv_imm);
    rdmaConnSetWriteCallback(conn, on_write);
    rdmaConnSetReadCallback(conn, on_read);
    rdmaConnSetConnectedCallback(conn, on_connected);
    rdmaConnSetDisconnectCallback(conn, on_disconnect);
    rdmaServerSetAcceptCallback(listener, on_accept);
    char msg[16] = "call back";
    rdmaConnSend(conn, msg, sizeof msg);
    rdmaConnSendWithImm(conn, 7, msg, sizeof msg);
    rdmaConnWrite(conn, msg, sizeof msg);
    rdmaConnWriteWithImm(conn, 8, msg, sizeof msg);
    struct ibv_mr *mr = rdmaConnRegMem(conn, 4096);
    if (mr != NULL && conn->tx_addr != NULL) {
        /* One-sided operations on the far end of the peer's receive ring,
         * which this short exchange of messages never reaches. */
        char *far = conn->tx_addr + conn->tx_length - 4096;
        rdmaConnRead(conn, mr->addr, mr->lkey, far, conn->tx_key, 64);
        rdmaConnReadBuf(conn, (char *)mr->addr + 1024, 64);
        /* The synchronous ones wait for their completion inside the
         * callback, while messages keep arriving. */
        rdmaSyncWriteSignaled(conn, (uint64_t)mr->addr, mr->lkey, (uint64_t)far, conn->tx_key, 64);
        rdmaSyncReadSignaled(conn, (uint64_t)mr->addr, mr->lkey, (uint64_t)far, conn->tx_key, 64);
    }
    printf("%s %s: every call returned\n", s == SERVER ? "server" : "client", kind_names[k]);
    atomic_store(&done[s][k], 1);
}

static void on_recv(RdmaConn *conn, void *data, size_t len)
{
    (void)data, (void)len;
    call_everything(conn, RECV);
}

static void on_recv_imm(RdmaConn *conn, uint32_t imm, void *data, size_t len)
{
    (void)imm, (void)data, (void)len;
    call_everything(conn, RECV_IMM);
}

static void on_write(RdmaConn *conn, size_t len)
{
    (void)len;
    call_everything(conn, WRITE);
}

static void on_read(RdmaConn *conn, size_t len)
{
    (void)len;
    call_everything(conn, READ);
}

static void on_connected(RdmaConn *conn)
{
    call_everything(conn, CONNECTED);
}

static void on_disconnect(RdmaConn *conn)
{
    call_everything(conn, DISCONNECT);
}

static void on_accept(RdmaConn *conn)
{
    int i = atomic_fetch_add(&n_accepted, 1);
    if (i == 2) {
        /* The third one is refused: closed before it was accepted. */
        refused_here = conn;
        rdmaConnClose(conn);
        return;
    }
    if (i < 2)
        accepted[i] = conn;
    rdmaConnSetRecvImmCallback(conn, on_recv_imm);
    call_everything(conn, ACCEPT);
}

static void *serve(void *l)
{
    rdmaServerStart(l);
    return NULL;
}

/* Waits up to 30 s for every kind in `kinds` to have run its calls on `s`. */
static int wait_done(enum side s, const enum kind *kinds, int n)
{
    for (int tries = 0; tries < 3000; tries++) {
        int all = 1;
        for (int i = 0; i < n; i++)
            all &= atomic_load(&done[s][kinds[i]]);
        if (all)
            return 1;
        struct timespec ms = {0, 10 * 1000 * 1000};
        nanosleep(&ms, NULL);
    }
    return 0;
}

static void report(void)
{
    for (int s = 0; s < SIDES; s++)
        for (int k = 0; k < KINDS; k++)
            if (!(s == CLIENT && k == ACCEPT))
                printf("%s %-10s %s\n", s == SERVER ? "server" : "client", kind_names[k],
                       atomic_load(&done[s][k]) ? "ok" : atomic_load(&entered[s][k]) ? "STUCK" : "never ran");
}

static void on_alarm(int sig)
{
    (void)sig;
    static const char msg[] = "callbacks: timed out (a call from a callback hangs)\n";
    ssize_t n = write(STDOUT_FILENO, msg, sizeof msg - 1);
    (void)n;
    _exit(3);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s <ip> <port>\n", argv[0]);
        return 2;
    }
    char *ip = argv[1];
    int port = atoi(argv[2]);
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGALRM, on_alarm);
    alarm(120);

    RdmaServerOptions sopt = {0};
    sopt.accept_callback = on_accept;
    sopt.recv_callback = on_recv;
    sopt.write_callback = on_write;
    sopt.read_callback = on_read;
    sopt.connected_callback = on_connected;
    sopt.disconnect_callback = on_disconnect;
    if (rdmaServer(&listener, ip, port, &sopt) != RDMA_OK) {
        fprintf(stderr, "callbacks: rdmaServer failed\n");
        return 1;
    }
    pthread_t t;
    pthread_create(&t, NULL, serve, listener);

    RdmaConnOptions copt = sopt;
    copt.accept_callback = NULL;
    RdmaConn *a = rdmaConn(&copt), *b = rdmaConn(&copt);
    rdmaConnSetRecvImmCallback(a, on_recv_imm);
    rdmaConnSetRecvImmCallback(b, on_recv_imm);
    if (rdmaConnect(a, ip, port) != RDMA_OK) {
        fprintf(stderr, "callbacks: connect failed\n");
        return 1;
    }
    if (rdmaConnect(b, ip, port) != RDMA_OK) {
        fprintf(stderr, "callbacks: second connect failed\n");
        return 1;
    }
    /* Closing a connection inside the accept callback rejects its peer. */
    RdmaConn *refused = rdmaConn(NULL);
    int ok = rdmaConnect(refused, ip, port) != RDMA_OK && errno == ECONNREFUSED;
    if (!ok)
        fprintf(stderr, "callbacks: a connection closed in the accept callback was not rejected (%s)\n",
                strerror(errno));
    rdmaConnClose(refused);
    const enum kind data_kinds[] = {CONNECTED, RECV, RECV_IMM, WRITE, READ};
    ok &= wait_done(CLIENT, data_kinds, 5);
    ok &= wait_done(SERVER, data_kinds, 5);
    ok &= wait_done(SERVER, (enum kind[]){ACCEPT}, 1);
    /* Every side of a connection that is up reads MR_READY, whichever of
     * the library's threads reported its last change. */
    RdmaConn *up[] = {a, b, accepted[0], accepted[1]};
    for (int i = 0; i < 4; i++)
        if (up[i] == NULL || up[i]->state != RDMA_CONN_STATE_MR_READY) {
            fprintf(stderr, "callbacks: connection %d reads state %d, not MR_READY\n", i,
                    up[i] == NULL ? -1 : (int)up[i]->state);
            ok = 0;
        }
    /* The client leaves: the server's disconnect callback. */
    rdmaConnClose(a);
    ok &= wait_done(SERVER, (enum kind[]){DISCONNECT}, 1);
    /* The server ends the other connection: the client's. */
    if (atomic_load(&n_accepted) >= 2)
        rdmaConnClose(accepted[1]);
    ok &= wait_done(CLIENT, (enum kind[]){DISCONNECT}, 1);
    if (atomic_load(&refused_called)) {
        fprintf(stderr, "callbacks: a callback ran for the connection refused in accept\n");
        ok = 0;
    }
    rdmaConnClose(b);
    rdmaServerStop(listener);
    pthread_join(t, NULL);
    rdmaServerRelease(listener);
    rdmaRuntimeStop();
    report();
    printf("callbacks: %s\n", ok ? "every callback kind called everything" : "FAILED");
    return ok ? 0 : 1;
}
