/* Handles used after their end, as careless programs do: a closed
 * connection, listener and key-value handles used again after many new
 * objects of their kind were made (each must answer with its error, never
 * act on a new object), and a server that keeps an accepted connection
 * after its disconnect callback and reads its state. Built with
 * -fsanitize=address too: reading freed memory fails that build.
 *
 *   handles <ip> <port>     (uses <port> to <port>+2)
 *
 * Exits 0 when all behaved. */
#include <kv_store.h>
#include <rdma.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Fewer than the 1024 objects a dead handle's address is kept from. */
#define NEW_OBJECTS 1000

static int failures, checks;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static RdmaConn *accepted;
static int server_disconnects;

#include "check.h"

static void on_server_disconnect(RdmaConn *conn)
{
    (void)conn;
    pthread_mutex_lock(&mu);
    server_disconnects++;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void on_accept(RdmaConn *conn)
{
    rdmaConnSetDisconnectCallback(conn, on_server_disconnect);
    pthread_mutex_lock(&mu);
    accepted = conn;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static int was_accepted(void)
{
    return accepted != NULL;
}

static int server_saw_disconnect(void)
{
    return server_disconnects > 0;
}

/* Waits up to 10 s for cond() (called under mu). */
static int wait_until(int (*cond)(void))
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 10;
    pthread_mutex_lock(&mu);
    while (!cond() && pthread_cond_timedwait(&cv, &mu, &deadline) == 0)
        ;
    int ok = cond();
    pthread_mutex_unlock(&mu);
    return ok;
}

static void *serve(void *l)
{
    rdmaServerStart(l);
    return NULL;
}

/* Makes NEW_OBJECTS connections (closing each): none may get `dead`'s
 * address, and `dead` stays refused throughout. */
static int new_conns_avoid(RdmaConn *dead)
{
    int ok = 1;
    for (int i = 0; i < NEW_OBJECTS; i++) {
        RdmaConn *c = rdmaConn(NULL);
        if (c == NULL || c == dead || rdmaConnSetRecvCallback(dead, NULL) != RDMA_ERR)
            ok = 0;
        rdmaConnClose(c);
    }
    return ok;
}

static void dead_connection(char *ip, int port)
{
    const size_t err = (size_t)-1;
    char buf[8] = "data";
    RdmaListener *l = NULL;
    RdmaServerOptions sopt = {0};
    sopt.accept_callback = on_accept;
    CHECK(rdmaServer(&l, ip, port, &sopt) == RDMA_OK, "rdmaServer");
    pthread_t t;
    pthread_create(&t, NULL, serve, l);

    RdmaConn *a = rdmaConn(NULL);
    CHECK(rdmaConnect(a, ip, port) == RDMA_OK, "connect");
    CHECK(wait_until(was_accepted), "the server accepted it");
    pthread_mutex_lock(&mu);
    RdmaConn *kept = accepted;
    pthread_mutex_unlock(&mu);

    rdmaConnClose(a);
    CHECK(wait_until(server_saw_disconnect), "the server's disconnect callback fired");
    /* The runtime lets go of the accepted connection right after the
     * callback; from then on the handle is refused. */
    int refused = 0;
    for (int i = 0; i < 1000 && !refused; i++) {
        refused = rdmaConnSetRecvCallback(kept, NULL) == RDMA_ERR;
        if (!refused) {
            struct timespec ms = {0, 10 * 1000 * 1000};
            nanosleep(&ms, NULL);
        }
    }
    CHECK(refused, "the ended accepted connection is refused");
    CHECK(kept->state == RDMA_CONN_STATE_CLOSED, "the kept accepted connection reads state CLOSED");

    CHECK(new_conns_avoid(a), "1000 new connections: none at the closed one's address, which stays refused");
    CHECK(kept->state == RDMA_CONN_STATE_CLOSED && kept->type == ACCEPTED_CONN,
          "... and the kept accepted connection still reads CLOSED");
    /* Its address text lives with the struct (under ASan, a read of freed
     * memory here fails the program). The client connected from the
     * server's own address. */
    CHECK(kept->ip != NULL && strcmp(kept->ip, ip) == 0,
          "... and its ip still reads the peer's address");
    CHECK(rdmaConnSend(a, buf, 4) == err, "send on the closed connection -> (size_t)-1");
    CHECK(rdmaConnSendWithImm(a, 1, buf, 4) == err, "send with imm -> (size_t)-1");
    CHECK(rdmaConnWrite(a, buf, 4) == err, "write -> (size_t)-1");
    CHECK(rdmaConnWriteWithImm(a, 1, buf, 4) == RDMA_ERR, "write with imm -> RDMA_ERR");
    CHECK(rdmaConnRegMem(a, 64) == NULL, "rdmaConnRegMem -> NULL");
    CHECK(rdmaSyncReadSignaled(a, 0, 0, 0, 0, 8) == RDMA_ERR, "sync read -> RDMA_ERR");
    errno = 0;
    CHECK(rdmaConnect(a, ip, port) == RDMA_ERR && errno == EINVAL, "connect -> RDMA_ERR, errno EINVAL");
    CHECK(rdmaConnSend(kept, buf, 4) == err, "send on the ended accepted connection -> (size_t)-1");
    rdmaConnClose(a);
    rdmaConnClose(kept);

    rdmaServerStop(l);
    pthread_join(t, NULL);
    rdmaServerRelease(l);
    CHECK(rdmaServerStart(l) == RDMA_ERR, "rdmaServerStart on a released listener -> RDMA_ERR");
    CHECK(rdmaServerSetAcceptCallback(l, on_accept) == RDMA_ERR, "set accept callback -> RDMA_ERR");
    RdmaListener *l2 = NULL;
    CHECK(rdmaServer(&l2, ip, port + 1, NULL) == RDMA_OK && l2 != l, "a new listener gets another address");
    CHECK(rdmaServerStop(l) == RDMA_ERR, "... and the released one stays refused");
    rdmaServerRelease(l2);
    rdmaServerRelease(l);
}

/* rdmaRuntimeStop closes the accepted connections and lets go of their
 * handles, which are refused from then on. */
static void stopped_runtime(char *ip, int port)
{
    RdmaListener *l = NULL;
    RdmaServerOptions sopt = {0};
    sopt.accept_callback = on_accept;
    pthread_mutex_lock(&mu);
    accepted = NULL;
    pthread_mutex_unlock(&mu);
    CHECK(rdmaServer(&l, ip, port, &sopt) == RDMA_OK, "a server for the runtime stop");
    pthread_t t;
    pthread_create(&t, NULL, serve, l);
    RdmaConn *a = rdmaConn(NULL);
    CHECK(rdmaConnect(a, ip, port) == RDMA_OK && wait_until(was_accepted), "... accepts a client");
    pthread_mutex_lock(&mu);
    RdmaConn *kept = accepted;
    pthread_mutex_unlock(&mu);
    rdmaRuntimeStop();
    CHECK(rdmaConnSetRecvCallback(kept, NULL) == RDMA_ERR,
          "after rdmaRuntimeStop the accepted connection's handle is refused");
    rdmaServerStop(l);
    pthread_join(t, NULL);
    rdmaServerRelease(l);
    rdmaConnClose(a);
}

static void dead_kv_handles(const char *ip, int port)
{
    char buf[8];
    size_t len = sizeof buf;
    kv_client_t *dead = kv_client_create(CONN_MODE_CM);
    kv_client_destroy(dead);
    int ok = 1;
    for (int i = 0; i < NEW_OBJECTS; i++) {
        kv_client_t *c = kv_client_create(CONN_MODE_CM);
        if (c == NULL || c == dead)
            ok = 0;
        kv_client_destroy(c);
    }
    CHECK(ok, "1000 new kv clients: none at the destroyed one's address");
    CHECK(kv_client_get(dead, "k", 1, buf, &len) == KV_ERR_INVALID_ARGUMENT, "get on a destroyed kv client");
    CHECK(kv_client_connect(dead, ip, port) == KV_ERR_INVALID_ARGUMENT, "connect a destroyed kv client");
    kv_client_destroy(dead);

    kv_config_t cfg = {.memory_size = 4u << 20, .hash_table_size = 64, .num_workers = 1};
    snprintf(cfg.bind_ip, sizeof cfg.bind_ip, "%s", ip);
    cfg.port = port;
    kv_server_t *s = kv_server_create(&cfg);
    CHECK(s != NULL && kv_server_start(s) == KV_OK, "a kv server");
    char name[80];
    snprintf(name, sizeof name, "%s:%d", ip, port);
    void *h = NULL;
    CHECK(kv_open(name, &h) == 0, "kv_open");
    CHECK(kv_close(h) == 0, "kv_close");
    CHECK(kv_set(h, "k", "v") == 1, "kv_set on a closed handle -> 1");
    CHECK(kv_close(h) == 1, "a second kv_close -> 1");
    kv_server_destroy(s);
    CHECK(kv_server_start(s) == KV_ERR_INVALID_ARGUMENT, "kv_server_start on a destroyed server");
    CHECK(kv_server_port(s) == -1, "kv_server_port on a destroyed server -> -1");
    kv_server_t *s2 = kv_server_create(&cfg);
    CHECK(s2 != NULL && s2 != s, "a new kv server gets another address");
    kv_server_destroy(s2);
    kv_server_destroy(s);
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s <ip> <port>\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[2]);
    dead_connection(argv[1], port);
    dead_kv_handles(argv[1], port + 2);
    /* The port of dead_connection's second listener, released. */
    stopped_runtime(argv[1], port + 1);
    rdmaRuntimeStop();
    printf("handles: %d of %d checks behaved\n", checks - failures, checks);
    return failures ? 1 : 0;
}
