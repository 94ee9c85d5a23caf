/* kv_check: the kv_client_* / kv_server_* API from C, as a legacy program
 * uses it, with checks that fail loudly.
 *
 *   kv_check <ip>                  embeds a server on <ip> (port chosen), checks it
 *   kv_check <ip> <port>           checks the server at <ip>:<port> (RDMA CM)
 *   kv_check <ip> <port> socket    the same in socket mode (first device)
 *
 * Exit 0 and "kv_check: all checks passed" when everything held. */
#include <kv_store.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
static conn_mode_t mode = CONN_MODE_CM;

#define CHECK(cond, ...)                                      \
    do {                                                      \
        if (!(cond)) {                                        \
            fprintf(stderr, "kv_check: FAILED %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                     \
            fprintf(stderr, "\n");                            \
            failures++;                                       \
        }                                                     \
    } while (0)

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)((i * 31u + seed) >> 3);
}

static void check_client(const char *ip, int port) {
    kv_client_t *c = kv_client_create(mode);
    CHECK(c != NULL, "kv_client_create");
    CHECK(kv_client_put(c, "k", 1, "v", 1) == KV_ERR_DISCONNECTED, "put before connect");
    if (mode == CONN_MODE_SOCKET)
        CHECK(kv_client_connect_socket(c, ip, port, NULL) == 0, "socket-mode connect to %s:%d", ip, port);
    else
        CHECK(kv_client_connect(c, ip, port) == 0, "connect to %s:%d", ip, port);

    char buf[64];
    size_t len = sizeof buf;
    uint64_t ver = 0;
    CHECK(kv_client_put(c, "key", 3, "value", 5) == KV_OK, "put");
    CHECK(kv_client_get(c, "key", 3, buf, &len) == KV_OK && len == 5 && memcmp(buf, "value", 5) == 0, "get");
    len = 2;
    CHECK(kv_client_get(c, "key", 3, buf, &len) == KV_ERR_BUFFER_TOO_SMALL && len == 5,
          "short buffer reports the length (%zu)", len);
    CHECK(kv_client_cas(c, "key", 3, 1, "new", 3, &ver) == KV_OK && ver == 2, "cas 1 -> 2 (%llu)",
          (unsigned long long)ver);
    CHECK(kv_client_cas(c, "key", 3, 1, "old", 3, &ver) == KV_ERR_CAS_FAILED && ver == 2,
          "stale cas reports version 2 (%llu)", (unsigned long long)ver);
    CHECK(kv_client_delete(c, "key", 3) == KV_OK, "delete");
    len = sizeof buf;
    CHECK(kv_client_get(c, "key", 3, buf, &len) == KV_ERR_NOT_FOUND, "get after delete");
    CHECK(kv_client_delete(c, "key", 3) == KV_ERR_NOT_FOUND, "delete twice");

    /* Large values, byte-checked: staged (1 MiB) and server target (64 MiB). */
    size_t sizes[] = {5000, 1 << 20, 64 << 20};
    for (unsigned i = 0; i < 3; i++) {
        size_t n = sizes[i];
        unsigned char *v = malloc(n), *back = malloc(n);
        fill(v, n, i + 1);
        CHECK(kv_client_put(c, "big", 3, v, n) == KV_OK, "put %zu bytes", n);
        size_t got = n;
        memset(back, 0, n);
        CHECK(kv_client_get_version(c, "big", 3, back, &got, &ver) == KV_OK && got == n, "get %zu", n);
        CHECK(memcmp(v, back, n) == 0, "%zu bytes come back intact", n);
        CHECK(ver == i + 1, "version %u (%llu)", i + 1, (unsigned long long)ver);
        /* One-sided: from the slab pool, or (64 MiB) asked of the server. */
        got = n;
        memset(back, 0, n);
        CHECK(kv_client_get_onesided(c, "big", 3, back, &got, &ver) == KV_OK && got == n && ver == i + 1,
              "one-sided get %zu", n);
        CHECK(memcmp(v, back, n) == 0, "%zu bytes come back intact one-sided", n);
        got = n - 1;
        CHECK(kv_client_get_onesided(c, "big", 3, back, &got, NULL) == KV_ERR_BUFFER_TOO_SMALL && got == n,
              "one-sided short buffer reports the length (%zu)", got);
        free(v);
        free(back);
    }

    /* Batches. */
    enum { N = 16 };
    char kbuf[N][16], vbuf[N][16], out[N][16];
    const char *keys[N];
    const void *vals[N];
    void *outs[N];
    size_t klens[N], vlens[N], olens[N];
    for (int i = 0; i < N; i++) {
        klens[i] = (size_t)snprintf(kbuf[i], sizeof kbuf[i], "batch-%d", i);
        vlens[i] = (size_t)snprintf(vbuf[i], sizeof vbuf[i], "value-%d", i * i);
        keys[i] = kbuf[i];
        vals[i] = vbuf[i];
        outs[i] = out[i];
        olens[i] = sizeof out[i];
    }
    CHECK(kv_client_batch_put(c, keys, klens, vals, vlens, N) == N, "batch put");
    CHECK(kv_client_batch_get(c, keys, klens, outs, olens, N) == N, "batch get");
    for (int i = 0; i < N; i++)
        CHECK(olens[i] == vlens[i] && memcmp(out[i], vbuf[i], vlens[i]) == 0, "batch value %d", i);
    for (int i = 0; i < N; i++) {
        memset(out[i], 0, sizeof out[i]);
        olens[i] = sizeof out[i];
    }
    olens[3] = 2;
    CHECK(kv_client_batch_get_onesided(c, keys, klens, outs, olens, N) == N - 1,
          "one-sided batch get (one buffer too short)");
    for (int i = 0; i < N; i++)
        CHECK(olens[i] == vlens[i] && (i == 3 || memcmp(out[i], vbuf[i], vlens[i]) == 0),
              "one-sided batch value %d", i);
    len = sizeof buf;
    CHECK(kv_client_get_onesided(c, "no-such-key", 11, buf, &len, NULL) == KV_ERR_NOT_FOUND,
          "one-sided get of a missing key");
    CHECK(kv_client_batch_get_onesided(c, NULL, klens, outs, olens, N) == -1, "one-sided batch of NULL keys");

    /* Bad input. */
    char longkey[1025];
    memset(longkey, 'k', sizeof longkey);
    CHECK(kv_client_put(c, longkey, 1025, "v", 1) == KV_ERR_KEY_TOO_LONG, "1025-byte key");
    CHECK(kv_client_put(c, longkey, 1024, "v", 1) == KV_OK, "1024-byte key");
    CHECK(kv_client_put(c, NULL, 3, "v", 1) == KV_ERR_INVALID_ARGUMENT, "NULL key");
    CHECK(kv_client_put(c, "k", 1, NULL, 4) == KV_ERR_INVALID_ARGUMENT, "NULL value");
    CHECK(kv_client_get(c, "k", 1, buf, NULL) == KV_ERR_INVALID_ARGUMENT, "NULL value_len");
    CHECK(kv_client_put(NULL, "k", 1, "v", 1) == KV_ERR_INVALID_ARGUMENT, "NULL client");
    CHECK(kv_client_connect(NULL, ip, port) == KV_ERR_INVALID_ARGUMENT, "connect NULL client");
    /* Lengths no object has: refused before anything is read. */
    size_t huge = SIZE_MAX;
    CHECK(kv_client_put(c, "k", SIZE_MAX, "v", 1) == KV_ERR_KEY_TOO_LONG, "SIZE_MAX key");
    CHECK(kv_client_delete(c, "k", SIZE_MAX) == KV_ERR_KEY_TOO_LONG, "delete of a SIZE_MAX key");
    CHECK(kv_client_put(c, "k", 1, "v", SIZE_MAX) == KV_ERR_INVALID_ARGUMENT, "SIZE_MAX value");
    CHECK(kv_client_cas(c, "k", 1, 0, "v", SIZE_MAX, NULL) == KV_ERR_INVALID_ARGUMENT, "CAS of a SIZE_MAX value");
    CHECK(kv_client_get(c, "k", 1, buf, &huge) == KV_ERR_INVALID_ARGUMENT, "get into a SIZE_MAX buffer");
    const char *k1[1] = {"k"};
    size_t kl1[1] = {SIZE_MAX}, vl1[1] = {1};
    const void *v1[1] = {"v"};
    CHECK(kv_client_batch_put(c, k1, kl1, v1, vl1, 1) == -1, "batch put of a SIZE_MAX key");
    kl1[0] = 1;
    vl1[0] = SIZE_MAX;
    CHECK(kv_client_batch_put(c, k1, kl1, v1, vl1, 1) == -1, "batch put of a SIZE_MAX value");
    /* A connect failure is not "no such key". */
    kv_client_t *refused = kv_client_create(mode);
    int rc = mode == CONN_MODE_SOCKET ? kv_client_connect_socket(refused, ip, 1, NULL) : kv_client_connect(refused, ip, 1);
    CHECK(rc < 0 && rc != KV_ERR_NOT_FOUND, "connect where nothing listens: %d (%s)", rc, kv_strerror(rc));
    kv_client_destroy(refused);
    CHECK(strlen(kv_strerror(KV_ERR_CAS_FAILED)) > 0, "strerror");

    kv_client_disconnect(c);
    CHECK(kv_client_put(c, "k", 1, "v", 1) == KV_ERR_DISCONNECTED, "put after disconnect");
    kv_client_destroy(c);
    kv_client_destroy(c); /* a second destroy is ignored */
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 4 || (argc == 4 && strcmp(argv[3], "socket") != 0)) {
        fprintf(stderr, "usage: %s <ip> [port [socket]]\n", argv[0]);
        return 2;
    }
    if (argc == 4)
        mode = CONN_MODE_SOCKET;
    kv_server_t *server = NULL;
    int port;
    if (argc >= 3) {
        port = atoi(argv[2]);
    } else {
        kv_config_t cfg = {
            .port = 0,
            .memory_size = 64u << 20,
            .use_huge_pages = false,
            .hash_table_size = 1024,
            .num_workers = 2,
            .conn_mode = CONN_MODE_CM,
        };
        snprintf(cfg.bind_ip, sizeof cfg.bind_ip, "%s", argv[1]);
        server = kv_server_create(&cfg);
        CHECK(server != NULL, "kv_server_create");
        CHECK(kv_server_start(server) == 0, "kv_server_start");
        port = kv_server_port(server);
        CHECK(port > 0, "kv_server_port");
    }
    check_client(argv[1], port);
    if (server) {
        char line[512];
        CHECK(kv_server_stats(server, line, sizeof line) > 0, "stats");
        printf("kv_check: server: %s\n", line);
        kv_server_stop(server);
        kv_server_destroy(server);
    }
    if (failures) {
        fprintf(stderr, "kv_check: %d checks failed\n", failures);
        return 1;
    }
    printf("kv_check: all checks passed\n");
    return 0;
}
