"""Top frames of a py-spy profile in collapsed-stack form (`py-spy record --format raw`).

    python -m bench.profile_summary PROFILE.txt [--top 25] [--thread timewheel-dispatch]

Prints, per sampled thread, its share of the samples, then the functions with the most samples on
top of the stack (self) and anywhere in it (inclusive), as percentages of all samples. Idle
threads (waiting on a lock, a condition or a socket) are counted under the frames they wait in:
`--active` leaves out samples whose top frame is such a wait.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path
from typing import Sequence

#: the method names (after the last dot) of frames that wait rather than work
_WAITS = re.compile(r"^(?:.*\.)?(wait|_wait|acquire|select|poll|recv_into|recv|sleep|epoll|join|accept|readinto) \(")


def _frame_name(frame: str) -> str:
    """`func (module/path.py:123)` -> `func (path.py)`, so lines of one function add up."""
    m = re.match(r"(.*) \((.*?):\d+\)$", frame)
    if not m:
        return frame
    return f"{m.group(1)} ({Path(m.group(2)).name})"


def summarize(path: Path, top: int, thread: str | None, active: bool) -> str:
    """The report for one profile."""
    self_c: Counter[str] = Counter()
    incl_c: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        count = int(count_s)
        frames = stack.split(";")
        name = frames[0]
        if thread and thread not in name:
            continue
        names = [_frame_name(f) for f in frames[1:]]
        if not names:
            continue
        if active and _WAITS.match(names[-1]):
            continue
        total += count
        threads[name] += count
        self_c[names[-1]] += count
        for n in set(names):
            incl_c[n] += count
    if not total:
        return f"{path}: no samples"
    out = [f"{path}: {total} samples" + (" (waits left out)" if active else "")]
    out.append("threads:")
    out += [f"  {100 * c / total:5.1f}%  {t}" for t, c in threads.most_common(12)]
    out.append("self (top of stack):")
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in self_c.most_common(top)]
    out.append("inclusive:")
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in incl_c.most_common(top)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the summary of each profile given."""
    ap = argparse.ArgumentParser(prog="python -m bench.profile_summary", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", type=Path, nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", help="only threads whose name contains this")
    ap.add_argument("--active", action="store_true", help="leave out samples waiting in a lock, poll or sleep")
    args = ap.parse_args(argv)
    for p in args.profiles:
        print(summarize(p, args.top, args.thread, args.active))


if __name__ == "__main__":
    main()
