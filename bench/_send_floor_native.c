/* The native floor under one send (bench/send_floor.py's `native` mode): the bare mode's loop in C,
 * run by one call with the interpreter's lock released, so that what it costs is the kernel's and the
 * broker's round trip alone. Built at run time by the system's C compiler; never part of the engine. */
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int write_all(int fd, const char *p, long n) {
    while (n > 0) {
        ssize_t w = write(fd, p, (size_t)n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += w;
        n -= w;
    }
    return 0;
}

/* Every `period_ns` for `seconds`: write `frame` to `fd` and read one whole length-prefixed answer.
 * Returns the sends made, or a negative errno. */
long floor_loop(int fd, const char *frame, long frame_len, long period_ns, double seconds) {
    char buf[1 << 16];
    long have = 0, sends = 0;
    long long total = (long long)(seconds * 1e9);
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long long k = 1; k * period_ns <= total; k++) {
        long long at = (long long)start.tv_nsec + k * period_ns;
        struct timespec due = {start.tv_sec + (time_t)(at / 1000000000LL), (long)(at % 1000000000LL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL) == EINTR) {
        }
        int err = write_all(fd, frame, frame_len);
        if (err) return err;
        for (;;) {
            if (have >= 4) {
                long n = 4 + (long)(((uint32_t)(unsigned char)buf[0] << 24) | ((uint32_t)(unsigned char)buf[1] << 16) |
                                    ((uint32_t)(unsigned char)buf[2] << 8) | (uint32_t)(unsigned char)buf[3]);
                if (n > (long)sizeof buf) return -EMSGSIZE;
                if (have >= n) {
                    memmove(buf, buf + n, (size_t)(have - n));
                    have -= n;
                    break;
                }
            }
            ssize_t r = read(fd, buf + have, sizeof buf - (size_t)have);
            if (r == 0) return -ECONNRESET;
            if (r < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            have += r;
        }
        sends++;
    }
    return sends;
}
