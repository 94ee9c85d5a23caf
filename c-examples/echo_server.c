/* Echo server: every message (and its immediate) goes back to its sender.
 * Runs until SIGINT or SIGTERM, then prints how much it received and echoed.
 *
 *   echo_server <ip> <port> [legacy | legacy-blocking]
 *
 * By default it runs in blocking mode and counts every send that does not
 * return the message's length as a failure. "legacy" echoes exactly as the
 * legacy library's sample does: in the default (non-blocking) mode, from
 * the receive callback, ignoring what rdmaConnSend returns; such programs
 * rely on a send from a callback never being lost. "legacy-blocking" is the
 * same in blocking mode.
 *
 * Prints "listening on <ip>:<port>" once it accepts, and a line per
 * connection and disconnection. */
#include <rdma.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_ullong received_bytes;
static atomic_ullong received_messages;
static atomic_ullong echoed_bytes;
static atomic_ullong echoed_messages;
static atomic_int echo_failures;
static RdmaListener *listener;

static void count_received(size_t len)
{
    atomic_fetch_add(&received_bytes, len);
    atomic_fetch_add(&received_messages, 1);
}

static void echo(RdmaConn *conn, void *data, size_t len)
{
    count_received(len);
    /* Blocking mode: inside a callback a message that finds the ring full
     * is queued and sent in order, so nothing is dropped. */
    if (rdmaConnSend(conn, data, len) != len) {
        atomic_fetch_add(&echo_failures, 1);
        return;
    }
    atomic_fetch_add(&echoed_bytes, len);
    atomic_fetch_add(&echoed_messages, 1);
}

/* The legacy sample's echo: the return value is ignored. */
static void echo_ignoring_result(RdmaConn *conn, void *data, size_t len)
{
    count_received(len);
    rdmaConnSend(conn, data, len);
}

static void echo_imm(RdmaConn *conn, uint32_t imm, void *data, size_t len)
{
    if (rdmaConnSendWithImm(conn, imm, data, len) != len)
        atomic_fetch_add(&echo_failures, 1);
}

static void on_connected(RdmaConn *conn)
{
    printf("connected %s:%d\n", conn->ip, conn->port);
    fflush(stdout);
}

static void on_disconnect(RdmaConn *conn)
{
    printf("disconnected %s:%d\n", conn->ip, conn->port);
    fflush(stdout);
}

static void on_accept(RdmaConn *conn)
{
    rdmaConnSetRecvImmCallback(conn, echo_imm);
}

static void *wait_for_signal(void *arg)
{
    sigset_t *set = arg;
    int sig;
    sigwait(set, &sig);
    rdmaServerStop(listener);
    return NULL;
}

int main(int argc, char **argv)
{
    int legacy = argc == 4 && strncmp(argv[3], "legacy", 6) == 0;
    int blocking = argc == 3 || (legacy && strcmp(argv[3], "legacy-blocking") == 0);
    if (argc < 3 || argc > 4 || (argc == 4 && !legacy) ||
        (legacy && !blocking && strcmp(argv[3], "legacy") != 0)) {
        fprintf(stderr, "usage: %s <ip> <port> [legacy | legacy-blocking]\n", argv[0]);
        return 2;
    }
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* runtime threads inherit the mask */

    if (blocking)
        rdmaCommMode = RDMA_BLOCKING;
    RdmaServerOptions opt = {0};
    opt.recv_callback = legacy ? echo_ignoring_result : echo;
    opt.connected_callback = on_connected;
    opt.disconnect_callback = on_disconnect;
    if (rdmaServer(&listener, argv[1], atoi(argv[2]), &opt) != RDMA_OK) {
        fprintf(stderr, "cannot listen on %s:%s\n", argv[1], argv[2]);
        return 1;
    }
    rdmaServerSetAcceptCallback(listener, on_accept);
    pthread_t t;
    pthread_create(&t, NULL, wait_for_signal, &set);
    printf("listening on %s:%s\n", argv[1], argv[2]);
    fflush(stdout);
    rdmaServerStart(listener);
    pthread_join(t, NULL);
    rdmaServerRelease(listener);
    rdmaRuntimeStop();
    printf("received %llu bytes in %llu messages\n", (unsigned long long)received_bytes,
           (unsigned long long)received_messages);
    printf("echoed %llu bytes in %llu messages, %d failures\n", (unsigned long long)echoed_bytes,
           (unsigned long long)echoed_messages, (int)echo_failures);
    return echo_failures == 0 ? 0 : 1;
}
