/* A program written the way legacy SnowRDMA programs are: the README's short
 * forms (rdmaServer(&l, ip, port), rdmaConn(), rdmaConnRead(conn, buf, len)),
 * a zeroed options struct, callbacks that read conn->ip and conn->port, the
 * globals read and written, and the legacy logging macros. It runs a server
 * and a client in one process and exits 0 when the message round-trips.
 *
 * Builds with the legacy line:
 *   cc legacy_style.c -I include -L <dir> -lsnowrdma -lrdmacm -libverbs -lpthread
 *
 *   legacy_style <ip> <port> */
#include "rdma.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

static RdmaListener *server;
static volatile int got_reply;
static char reply[64];

/* "stall" keeps the library's completion thread in this callback a while,
 * so that the program's own call finds its failure (below). */
static volatile int stalling;

static void server_recv(RdmaConn *conn, void *data, size_t len)
{
    rdmaInfo("server got %zu bytes from %s:%d", len, conn->ip, conn->port);
    if (len == 6 && memcmp(data, "stall", 6) == 0) {
        stalling = 1;
        usleep(500000);
        return;
    }
    rdmaConnSend(conn, data, len);
}

static void server_accept(RdmaConn *conn)
{
    rdmaDebug("accepting %s:%d", conn->ip, conn->port);
    rdmaConnSetRecvCallback(conn, server_recv);
}

static void client_recv(RdmaConn *conn, void *data, size_t len)
{
    (void)conn;
    memcpy(reply, data, len < sizeof reply ? len : sizeof reply - 1);
    got_reply = 1;
}

/* The write callback follows every rdmaConnSend and rdmaConnWrite, as the
 * legacy library's did (it signaled each message when one was set), on a
 * library thread: main holds `mu` around its sends, and the callback takes
 * it. It writes again from inside, a few times, which must not recurse. */
#define CHAINED_WRITES 3
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_t main_thread;
static volatile size_t written, write_calls, chained;
static volatile int write_on_main, write_recursed, in_write, write_after_disconnect;
static volatile int disconnects, disconnect_on_main;

static void client_write(RdmaConn *conn, size_t len)
{
    if (in_write)
        write_recursed = 1;
    if (disconnects || disconnect_on_main)
        write_after_disconnect = 1;
    in_write = 1;
    if (pthread_equal(pthread_self(), main_thread))
        write_on_main = 1;
    pthread_mutex_lock(&mu);
    written += len;
    write_calls++;
    int again = write_calls > 1 && chained < CHAINED_WRITES;
    if (again)
        chained++;
    pthread_mutex_unlock(&mu);
    if (again)
        rdmaConnWrite(conn, "chained", 8);
    in_write = 0;
}

/* The disconnect callback takes `mu` too, and main holds it around the sync
 * READ that fails: the legacy library ran this callback on its event thread,
 * never inside the program's own call, and after the write callbacks of
 * what went before. */

static void client_disconnect(RdmaConn *conn)
{
    (void)conn;
    if (pthread_equal(pthread_self(), main_thread)) {
        disconnect_on_main = 1; /* taking `mu` here would deadlock */
        return;
    }
    pthread_mutex_lock(&mu);
    disconnects++;
    pthread_mutex_unlock(&mu);
}

static void *serve(void *arg)
{
    (void)arg;
    rdmaServerStart(server);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        rdmaErr("usage: %s <ip> <port>", argv[0]);
        return 2;
    }
    alarm(120); /* a hang fails the program */
    rdmaListenBacklog = 64;
    rdmaInfo("timeout %d ms, recv depth %d", rdmaTimeoutms, rdmaRecvDepth);
    if (rdmaServer(&server, argv[1], atoi(argv[2])) != RDMA_OK) {
        rdmaErr("rdmaServer failed");
        return 1;
    }
    rdmaServerSetAcceptCallback(server, server_accept);
    pthread_t t;
    pthread_create(&t, NULL, serve, NULL);

    main_thread = pthread_self();
    RdmaConn *conn = rdmaConn();
    rdmaConnSetRecvCallback(conn, client_recv);
    rdmaConnSetWriteCallback(conn, client_write);
    rdmaConnSetDisconnectCallback(conn, client_disconnect);
    if (rdmaConnect(conn, argv[1], atoi(argv[2])) != RDMA_OK) {
        rdmaErr("rdmaConnect failed");
        return 1;
    }
    char msg[] = "hello, snow";
    pthread_mutex_lock(&mu);
    size_t sent = rdmaConnSend(conn, msg, sizeof msg);
    pthread_mutex_unlock(&mu);
    if (sent != sizeof msg) {
        rdmaErr("rdmaConnSend failed");
        return 1;
    }
    for (int i = 0; i < 1000 && !got_reply; i++)
        usleep(10000);
    int ok = got_reply && strcmp(reply, msg) == 0;

    pthread_mutex_lock(&mu);
    ok = ok && rdmaConnWrite(conn, "written", 8) == 8;
    pthread_mutex_unlock(&mu);
    size_t want = sizeof msg + 8 + CHAINED_WRITES * 8;
    for (int i = 0; i < 1000 && written < want; i++)
        usleep(10000);
    if (written != want || write_calls != 2 + CHAINED_WRITES || write_on_main || write_recursed) {
        rdmaErr("write callbacks: %zu bytes in %zu calls (want %zu in %d), on main %d, recursed %d",
                (size_t)written, (size_t)write_calls, want, 2 + CHAINED_WRITES, write_on_main,
                write_recursed);
        ok = 0;
    }

    /* Short-form read: the start of the server's receive buffer holds what
     * we sent. */
    struct ibv_mr *mr = rdmaConnRegMem(conn, 4096);
    char *buf = mr->addr;
    ok = ok && rdmaConnRead(conn, buf, sizeof msg) == (int)sizeof msg;
    for (int i = 0; i < 1000 && ok && strcmp(buf, msg) != 0; i++)
        usleep(10000);
    ok = ok && strcmp(buf, msg) == 0;

    /* A wrong rkey fails the READ and, as RDMA does, the connection. The
     * completion thread is busy, so the READ's own wait finds the failure. */
    rdmaConnSend(conn, "stall", 6);
    for (int i = 0; i < 1000 && !stalling; i++)
        usleep(1000);
    pthread_mutex_lock(&mu);
    int failed = rdmaSyncReadSignaled(conn, (uint64_t)(uintptr_t)buf, mr->lkey,
                                      (uint64_t)(uintptr_t)conn->tx_addr, conn->tx_key ^ 0x77,
                                      8) == RDMA_ERR;
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < 1000 && !disconnects; i++)
        usleep(10000);
    usleep(200000); /* a second disconnect or a late write callback shows */
    if (!failed || disconnects != 1 || disconnect_on_main || write_after_disconnect) {
        rdmaErr("failed read: RDMA_ERR %d, %d disconnect callbacks, inside the call %d, a write "
                "callback after it %d",
                failed, disconnects, disconnect_on_main, write_after_disconnect);
        ok = 0;
    }
    rdmaConnDeregMem(conn, mr);

    rdmaConnClose(conn);
    rdmaServerStop(server);
    pthread_join(t, NULL);
    rdmaServerRelease(server);
    rdmaRuntimeStop();
    printf(ok ? "legacy-style program: ok\n" : "legacy-style program: FAILED\n");
    return ok ? 0 : 1;
}
