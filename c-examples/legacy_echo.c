/* An echo server written exactly as the legacy SnowRDMA sample is: the
 * receive callback sends the message back and ignores what rdmaConnSend
 * returns, in the default (non-blocking) mode unless "blocking" is given.
 * Legacy programs rely on a send from a callback never being lost; this
 * program is how the tests hold us to that.
 *
 *   legacy_echo <ip> <port> [blocking]
 *
 * Prints "listening on <ip>:<port>", then serves until SIGINT or SIGTERM. */
#include <rdma.h>

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static RdmaListener *listener;

static void echo(RdmaConn *conn, void *data, size_t len)
{
    rdmaConnSend(conn, data, len);
}

static void on_accept(RdmaConn *conn)
{
    rdmaConnSetRecvCallback(conn, echo);
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
    if (argc < 3 || argc > 4 || (argc == 4 && strcmp(argv[3], "blocking") != 0)) {
        fprintf(stderr, "usage: %s <ip> <port> [blocking]\n", argv[0]);
        return 2;
    }
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL); /* runtime threads inherit the mask */

    if (argc == 4)
        rdmaCommMode = RDMA_BLOCKING;
    if (rdmaServer(&listener, argv[1], atoi(argv[2])) != RDMA_OK) {
        fprintf(stderr, "rdmaServer failed\n");
        return 1;
    }
    rdmaServerSetAcceptCallback(listener, on_accept);
    pthread_t stopper;
    pthread_create(&stopper, NULL, wait_for_signal, &set);
    printf("listening on %s:%s\n", argv[1], argv[2]);
    fflush(stdout);
    rdmaServerStart(listener);
    pthread_join(stopper, NULL);
    rdmaServerRelease(listener);
    printf("stopped\n");
    return 0;
}
