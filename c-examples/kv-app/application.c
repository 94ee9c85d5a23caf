/* application: the legacy kv_open/kv_set/kv_get program, unchanged in
 * shape. With no argument it serves (run_server, port 4792); with one (the
 * server's name, optionally host:port) it runs the interactive test client
 * defined in client.c. Built by `make` with a `client` symlink to it. */
#include <kv_store.h>

#include <stdio.h>

int run_client(char *servername);

int main(int argc, char **argv) {
    if (argc == 1)
        return run_server();
    if (argc == 2)
        return run_client(argv[1]);
    fprintf(stderr, "usage: %s [server]\n", argv[0]);
    return 1;
}
