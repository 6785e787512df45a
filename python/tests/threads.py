"""Run one function per worker on threads (each fanin Session belongs to the
thread that made it) and re-raise the first failure."""

import threading


def in_threads(n, fn, timeout=60):
    out, errors = [None] * n, []

    def body(i):
        try:
            out[i] = fn(i)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    return out
