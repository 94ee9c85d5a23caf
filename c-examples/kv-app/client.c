/* client.c: the interactive test client of the kv_open/kv_set/kv_get API,
 * as the legacy program has it. It asks on stdin for one choice:
 *   1  functional tests (two eager keys, a 64 KiB-1 value, a 1 GiB value, a
 *      missing key reading as ""), ending in "Passed All Tests!"
 *   2  wait (at most 60 s) until the test keys another client wrote with 1
 *      are visible
 *   3  throughput for values of 1 B to 16 MiB (powers of two, 50 warm-ups,
 *      100 timed SET+GET pairs each), by wall clock:
 *      "Eager: <size>\t<rate>\tGB/Sec" below 4 KiB, "Rendezvous: ..." above
 * KV_CLIENT_BIG_MB sets the size of the large functional value (default 1024). */
#include <kv_store.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EAGER_LIMIT 4096

static int failed;

static void expect(void *kv, const char *key, const char *want) {
    char *got = NULL;
    if (kv_get(kv, key, &got) != 0) {
        fprintf(stderr, "kv_get(%.40s) failed\n", key);
        failed = 1;
        return;
    }
    if (strcmp(got, want) != 0) {
        fprintf(stderr, "kv_get(%.40s): wrong value (%zu bytes, wanted %zu)\n", key, strlen(got),
                strlen(want));
        failed = 1;
    }
    kv_release(got);
}

static char *filled(size_t len, char c) {
    char *s = malloc(len + 1);
    if (!s) {
        perror("malloc");
        exit(1);
    }
    for (size_t i = 0; i < len; i++)
        s[i] = (char)(c + i % 23);
    s[len] = '\0';
    return s;
}

static size_t big_len(void) {
    const char *mb = getenv("KV_CLIENT_BIG_MB");
    return (mb ? (size_t)atol(mb) : 1024) << 20;
}

static void set(void *kv, const char *key, const char *value) {
    if (kv_set(kv, key, value) != 0) {
        fprintf(stderr, "kv_set(%.40s) failed\n", key);
        failed = 1;
    }
}

static int functional(void *kv) {
    char *medium = filled(64 * 1024 - 1, 'a');
    char *big = filled(big_len(), 'A');
    set(kv, "test_key_1", "value one");
    set(kv, "test_key_2", "value two");
    set(kv, "test_key_medium", medium);
    set(kv, "test_key_big", big);
    expect(kv, "test_key_1", "value one");
    expect(kv, "test_key_2", "value two");
    expect(kv, "test_key_medium", medium);
    expect(kv, "test_key_big", big);
    expect(kv, "test_key_missing", "");
    free(medium);
    free(big);
    if (failed)
        return 1;
    printf("Passed All Tests!\n");
    return 0;
}

static int wait_for_other(void *kv) {
    char *medium = filled(64 * 1024 - 1, 'a');
    for (int tries = 0; tries < 600; tries++) {
        char *a = NULL, *b = NULL, *m = NULL;
        int ok = kv_get(kv, "test_key_1", &a) == 0 && kv_get(kv, "test_key_2", &b) == 0 &&
                 kv_get(kv, "test_key_medium", &m) == 0 && strcmp(a, "value one") == 0 &&
                 strcmp(b, "value two") == 0 && strcmp(m, medium) == 0;
        kv_release(a);
        kv_release(b);
        kv_release(m);
        if (ok) {
            printf("All test keys are visible\n");
            free(medium);
            return 0;
        }
        usleep(100 * 1000);
    }
    free(medium);
    fprintf(stderr, "the test keys did not appear within 60 s\n");
    return 1;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int throughput(void *kv) {
    const char *key = "throughput_key";
    for (size_t size = 1; size <= (16u << 20); size *= 2) {
        char *value = filled(size, 'x');
        char *got = NULL;
        for (int i = 0; i < 50; i++) {
            if (kv_set(kv, key, value) || kv_get(kv, key, &got)) {
                fprintf(stderr, "warm-up at %zu bytes failed\n", size);
                return 1;
            }
            kv_release(got);
        }
        double start = now();
        for (int i = 0; i < 100; i++) {
            if (kv_set(kv, key, value) || kv_get(kv, key, &got)) {
                fprintf(stderr, "run at %zu bytes failed\n", size);
                return 1;
            }
            kv_release(got);
        }
        double rate = 2.0 * 100 * (double)size / (now() - start) / 1e9;
        printf("%s: %zu\t%.6f\tGB/Sec\n", strlen(key) + size < EAGER_LIMIT ? "Eager" : "Rendezvous", size,
               rate);
        fflush(stdout);
        free(value);
    }
    return 0;
}

int run_client(char *servername) {
    void *kv = NULL;
    if (kv_open(servername, &kv) != 0) {
        fprintf(stderr, "cannot connect to %s\n", servername);
        return 1;
    }
    printf("1: functional tests, 2: wait for another client's keys, 3: throughput\n");
    fflush(stdout);
    char line[32];
    int rc = 1;
    if (fgets(line, sizeof line, stdin)) {
        switch (atoi(line)) {
        case 1: rc = functional(kv); break;
        case 2: rc = wait_for_other(kv); break;
        case 3: rc = throughput(kv); break;
        default: fprintf(stderr, "unknown choice: %s", line);
        }
    }
    kv_close(kv);
    return rc;
}
