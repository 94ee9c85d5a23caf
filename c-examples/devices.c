/* Lists the RDMA devices through libsnowrdma and checks that bad arguments
 * come back as error codes. Exits 0 when everything behaved; with
 * --require-device, also requires at least one device.
 *
 * Build: cc -Wall -Wextra -Werror -I include devices.c -L <libdir> -lsnowrdma */
#include <rdma.h>

#include <stdio.h>
#include <string.h>

static int expect(snowrdma_result got, snowrdma_result want, const char *what)
{
    if (got == want)
        return 0;
    fprintf(stderr, "%s: got %d (%s), expected %d (%s)\n", what, (int)got,
            snowrdma_strerror((int)got), (int)want, snowrdma_strerror((int)want));
    return 1;
}

int main(int argc, char **argv)
{
    int require_device = argc > 1 && strcmp(argv[1], "--require-device") == 0;
    int failures = 0;
    size_t count = 0;
    char name[64];
    char tiny[2];

    printf("snowrdma %s\n", snowrdma_version());
    failures += expect(snowrdma_device_count(NULL), SNOWRDMA_ERR_INVALID_ARGUMENT,
                       "device_count(NULL)");
    failures += expect(snowrdma_device_name(0, NULL, sizeof name), SNOWRDMA_ERR_INVALID_ARGUMENT,
                       "device_name(NULL buffer)");
    failures += expect(snowrdma_device_count(&count), SNOWRDMA_OK, "device_count");
    printf("%zu RDMA device(s)\n", count);
    for (size_t i = 0; i < count; i++) {
        if (expect(snowrdma_device_name(i, name, sizeof name), SNOWRDMA_OK, "device_name"))
            failures++;
        else
            printf("  %s\n", name);
    }
    failures += expect(snowrdma_device_name(count, name, sizeof name), SNOWRDMA_ERR_NO_DEVICE,
                       "device_name(past the end)");
    if (count > 0)
        failures += expect(snowrdma_device_name(0, tiny, sizeof tiny),
                           SNOWRDMA_ERR_BUFFER_TOO_SMALL, "device_name(2-byte buffer)");
    if (require_device && count == 0) {
        fprintf(stderr, "no RDMA device, but one is required\n");
        failures++;
    }
    return failures == 0 ? 0 : 1;
}
