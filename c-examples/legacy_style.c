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

static void server_recv(RdmaConn *conn, void *data, size_t len)
{
    rdmaInfo("server got %zu bytes from %s:%d", len, conn->ip, conn->port);
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
    rdmaListenBacklog = 64;
    rdmaInfo("timeout %d ms, recv depth %d", rdmaTimeoutms, rdmaRecvDepth);
    if (rdmaServer(&server, argv[1], atoi(argv[2])) != RDMA_OK) {
        rdmaErr("rdmaServer failed");
        return 1;
    }
    rdmaServerSetAcceptCallback(server, server_accept);
    pthread_t t;
    pthread_create(&t, NULL, serve, NULL);

    RdmaConn *conn = rdmaConn();
    rdmaConnSetRecvCallback(conn, client_recv);
    if (rdmaConnect(conn, argv[1], atoi(argv[2])) != RDMA_OK) {
        rdmaErr("rdmaConnect failed");
        return 1;
    }
    char msg[] = "hello, snow";
    if (rdmaConnSend(conn, msg, sizeof msg) != sizeof msg) {
        rdmaErr("rdmaConnSend failed");
        return 1;
    }
    for (int i = 0; i < 1000 && !got_reply; i++)
        usleep(10000);
    int ok = got_reply && strcmp(reply, msg) == 0;

    /* Short-form read: the start of the server's receive buffer holds what
     * we sent. */
    struct ibv_mr *mr = rdmaConnRegMem(conn, 4096);
    char *buf = mr->addr;
    ok = ok && rdmaConnRead(conn, buf, sizeof msg) == (int)sizeof msg;
    for (int i = 0; i < 1000 && ok && strcmp(buf, msg) != 0; i++)
        usleep(10000);
    ok = ok && strcmp(buf, msg) == 0;
    rdmaConnDeregMem(conn, mr);

    rdmaConnClose(conn);
    rdmaServerStop(server);
    pthread_join(t, NULL);
    rdmaServerRelease(server);
    rdmaRuntimeStop();
    printf(ok ? "legacy-style program: ok\n" : "legacy-style program: FAILED\n");
    return ok ? 0 : 1;
}
