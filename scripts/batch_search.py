"""The search behind scripts/max_batch.py: the largest batch that trains, found by trials,
each a fresh process. Standard library only, so the search runs and is tested without a GPU.

A trial answers one of two outcomes, FITS or OOM. Anything else (a crash, a timeout, an exit
status other than 0 and OOM_EXIT, an outcome that is neither) is a TrialError: the search
stops there and never counts it as an out-of-memory error.

    largest_fitting(trial, start=8, limit=4096) -> search_result
    subprocess_trial(command_for, timeout_s) -> a trial: command_for(batch) is run and its
        exit status read (0: FITS, OOM_EXIT: OOM)

The search assumes fitting is monotone (a batch that fits means every smaller one fits):
from `start` it doubles while trials fit (or halves while they fail), then bisects between
the largest batch that fitted and the smallest that did not, until they are adjacent or
within the tolerance."""

import json
import subprocess

FITS = "fits"
OOM = "oom"
# The exit status of a trial whose training ran out of memory (0: it fitted). Chosen apart
# from what Python gives an uncaught exception (1), a usage error (2) or a signal.
OOM_EXIT = 86


class TrialError(Exception):
    """A trial that neither fitted nor ran out of memory."""

    def __init__(self, batch, detail):
        super().__init__("batch %d: %s" % (batch, detail))
        self.batch = batch
        self.detail = detail


class search_result:
    """largest: the largest batch that fitted (0: not even 1). first_oom: the smallest batch
    that ran out of memory (None: none did up to the limit). trials: [(batch, outcome)] in
    the order run. capped: `limit` itself fitted, so the answer is a lower bound."""

    def __init__(self, largest, first_oom, trials, capped):
        self.largest, self.first_oom, self.trials, self.capped = largest, first_oom, trials, capped

    def as_dict(self):
        return {"largest": self.largest, "first_oom": self.first_oom, "capped": self.capped,
                "trials": [[b, o] for b, o in self.trials]}


def largest_fitting(trial, start=1, limit=4096, tolerance=0.0):
    """The largest batch in [1, limit] for which trial(batch) returns FITS. `tolerance`
    (a share, 0: exact) lets the bisection stop once the bracket is within that share of
    the batch that fitted. A TrialError from `trial` propagates; so does any outcome other
    than FITS and OOM, as a TrialError."""
    if limit < 1:
        raise ValueError("largest_fitting: limit must be at least 1, not %r" % (limit,))
    if tolerance < 0:
        raise ValueError("largest_fitting: tolerance must be 0 or more, not %r" % (tolerance,))
    trials = []

    def fits(batch):
        outcome = trial(batch)
        if outcome not in (FITS, OOM):
            raise TrialError(batch, "the trial answered %r, neither %r nor %r"
                             % (outcome, FITS, OOM))
        trials.append((batch, outcome))
        return outcome == FITS

    start = min(max(1, int(start)), limit)
    if fits(start):
        lo, hi = start, None
        while hi is None:
            if lo == limit:
                return search_result(lo, None, trials, True)
            nxt = min(limit, lo * 2)
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = 0, start
        while lo == 0:
            if hi == 1:
                return search_result(0, 1, trials, False)
            nxt = hi // 2
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
    while hi - lo > 1 and hi - lo > lo * tolerance:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return search_result(lo, hi, trials, False)


def run_trial(command, timeout_s, env=None):
    """Runs one trial process. Returns (outcome, the last JSON object it printed on stdout or
    None, its stderr's tail); raises TrialError for anything but exit 0 or OOM_EXIT."""
    batch = command.batch if hasattr(command, "batch") else -1
    try:
        p = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise TrialError(batch, "no answer within %g s (killed)" % timeout_s) from None
    except OSError as e:
        raise TrialError(batch, "could not start %r: %s" % (command[0], e)) from None
    tail = "\n".join(p.stderr.strip().splitlines()[-12:])
    if p.returncode == 0:
        return FITS, last_json(p.stdout), tail
    if p.returncode == OOM_EXIT:
        return OOM, last_json(p.stdout), tail
    how = ("killed by signal %d" % -p.returncode) if p.returncode < 0 \
        else "exit status %d" % p.returncode
    last = tail.splitlines()[-1] if tail else "(no output on stderr)"
    raise TrialError(batch, "%s, neither 0 (fitted) nor %d (out of memory): %s\nstderr:\n%s"
                     % (how, OOM_EXIT, last, tail))


class _command(list):
    """A command line that remembers the batch it tries (for TrialError's message)."""

    def __init__(self, argv, batch):
        super().__init__(argv)
        self.batch = batch


def subprocess_trial(command_for, timeout_s, env=None, on_result=None):
    """A trial for largest_fitting: command_for(batch) -> argv, run in a fresh process each
    time. on_result(batch, outcome, json_or_None, stderr_tail), when given, sees every
    answer (a log)."""

    def trial(batch):
        outcome, record, tail = run_trial(_command(command_for(batch), batch), timeout_s, env)
        if on_result is not None:
            on_result(batch, outcome, record, tail)
        return outcome

    return trial


def last_json(text):
    """The last line of `text` that parses as a JSON object, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
