"""scripts/batch_search.py and the torch-free parts of scripts/max_batch.py: the search finds
the largest batch that fits, each trial a fresh process (tests/scripts/fits_up_to.py fits up
to a known N); a trial that fails any other way than out of memory stops the search with an
error and is never counted as out of memory; each allocator's trial environment and the
table's ratios."""
import os
import sys
import tempfile
import unittest

ROOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import batch_search  # noqa: E402
import max_batch  # noqa: E402

TRIAL = os.path.join(ROOT, "tests", "scripts", "fits_up_to.py")


def process_trial(fits, *extra, timeout_s=30, log=None):
    """A subprocess trial of fits_up_to.py fitting up to `fits`."""
    def command(batch):
        argv = [sys.executable, TRIAL, str(batch), "--fits", str(fits)] + list(extra)
        return argv + (["--log", log] if log else [])
    return batch_search.subprocess_trial(command, timeout_s)


def in_process(fits, seen):
    def trial(batch):
        seen.append(batch)
        return batch_search.FITS if batch <= fits else batch_search.OOM
    return trial


class SearchInProcess(unittest.TestCase):
    """The search's logic over every answer and start in a range (no process: the same
    function the subprocess trial feeds)."""

    def test_every_answer_from_every_start(self):
        limit = 300
        for fits in list(range(0, 70)) + [127, 128, 129, 255, 299, 300, 1000]:
            for start in (1, 2, 5, 16, 64, 300):
                seen = []
                r = batch_search.largest_fitting(in_process(fits, seen), start, limit)
                want = min(fits, limit)
                self.assertEqual(r.largest, want, (fits, start))
                self.assertEqual(r.capped, fits >= limit, (fits, start))
                self.assertEqual(r.first_oom, None if fits >= limit else want + 1, (fits, start))
                self.assertEqual(len(seen), len(set(seen)), "a batch tried twice: %s" % seen)
                self.assertLessEqual(len(seen), 2 * limit.bit_length() + 2, (fits, start, seen))
                self.assertEqual([b for b, _ in r.trials], seen)

    def test_tolerance_stops_within_its_share(self):
        for fits in (40, 100, 1000, 3000):
            seen = []
            r = batch_search.largest_fitting(in_process(fits, seen), 8, 4096, tolerance=0.05)
            self.assertLessEqual(r.largest, fits)
            self.assertGreaterEqual(r.largest, fits / 1.05 - 1)
            self.assertLessEqual(r.first_oom - r.largest, max(1, r.largest * 0.05))
            exact = []
            batch_search.largest_fitting(in_process(fits, exact), 8, 4096)
            self.assertLessEqual(len(seen), len(exact))

    def test_an_answer_neither_fits_nor_oom_is_an_error(self):
        with self.assertRaises(batch_search.TrialError) as c:
            batch_search.largest_fitting(lambda b: "maybe", 4, 64)
        self.assertIn("'maybe'", str(c.exception))
        self.assertEqual(c.exception.batch, 4)

    def test_bad_arguments_are_refused(self):
        with self.assertRaises(ValueError):
            batch_search.largest_fitting(lambda b: batch_search.FITS, 1, 0)
        with self.assertRaises(ValueError):
            batch_search.largest_fitting(lambda b: batch_search.FITS, 1, 8, tolerance=-1)


class SearchOverProcesses(unittest.TestCase):
    """The search with each trial a fresh process of fits_up_to.py."""

    def test_finds_the_largest_batch_each_trial_a_fresh_process(self):
        for fits, start in ((37, 8), (1, 4), (0, 3), (5, 1)):
            with tempfile.TemporaryDirectory() as d:
                log = os.path.join(d, "trials")
                r = batch_search.largest_fitting(process_trial(fits, log=log), start, 4096)
                self.assertEqual(r.largest, fits)
                self.assertEqual(r.first_oom, fits + 1)
                with open(log, encoding="utf-8") as f:
                    runs = [tuple(map(int, line.split())) for line in f]
                self.assertEqual([b for b, _ in runs], [b for b, _ in r.trials])
                self.assertEqual(len({pid for _, pid in runs}), len(runs), "a process reused")
                for batch, outcome in r.trials:
                    self.assertEqual(outcome, batch_search.FITS if batch <= fits
                                     else batch_search.OOM)

    def test_reaching_the_limit_is_a_lower_bound(self):
        r = batch_search.largest_fitting(process_trial(10 ** 6), 16, 64)
        self.assertEqual((r.largest, r.capped, r.first_oom), (64, True, None))

    def test_an_exception_in_a_trial_is_an_error_not_oom(self):
        # 37 fits, so batch 48 (tried after 8, 16, 32, 64) would be out of memory; it
        # fails another way instead, and the search stops naming it.
        with self.assertRaises(batch_search.TrialError) as c:
            batch_search.largest_fitting(process_trial(37, "--fail-at", "48"), 8, 4096)
        self.assertEqual(c.exception.batch, 48)
        self.assertIn("exit status 1", str(c.exception))
        self.assertIn("CUBLAS_STATUS_EXECUTION_FAILED", str(c.exception))

    def test_a_failure_below_the_answer_is_an_error_too(self):
        with self.assertRaises(batch_search.TrialError) as c:
            batch_search.largest_fitting(process_trial(37, "--fail-at", "16"), 8, 4096)
        self.assertEqual(c.exception.batch, 16)

    def test_a_killed_trial_is_an_error(self):
        with self.assertRaises(batch_search.TrialError) as c:
            batch_search.largest_fitting(process_trial(37, "--abort-at", "64"), 8, 4096)
        self.assertIn("killed by signal 6", str(c.exception))
        self.assertEqual(c.exception.batch, 64)

    def test_a_trial_past_its_timeout_is_an_error(self):
        with self.assertRaises(batch_search.TrialError) as c:
            batch_search.largest_fitting(process_trial(37, "--hang-at", "16", timeout_s=3), 8, 64)
        self.assertIn("no answer within 3 s", str(c.exception))
        self.assertEqual(c.exception.batch, 16)

    def test_run_trial_reads_the_trials_json(self):
        outcome, record, _ = batch_search.run_trial(
            [sys.executable, TRIAL, "7", "--fits", "3"], 30)
        self.assertEqual(outcome, batch_search.OOM)
        self.assertEqual(record, {"batch": 7, "fits": False})
        with self.assertRaises(batch_search.TrialError):
            batch_search.run_trial(["/nonexistent/python-for-a-trial"], 30)


class MaxBatchDriver(unittest.TestCase):
    """What max_batch.py gives each side and how it tabulates."""

    def test_one_cap_and_each_sides_environment(self):
        base = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6",
                "GPUMEM_CONF": "footprint:tight", "GPUMEM_ENABLE": "1", "GPUMEM_LIB": "/x.so"}
        native = max_batch.trial_environment("native", base)
        self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", native)
        self.assertNotIn("GPUMEM_ENABLE", native)
        self.assertEqual(native["GPUMEM_LIB"], "/x.so")
        self.assertEqual(max_batch.trial_environment("expandable", base)["PYTORCH_CUDA_ALLOC_CONF"],
                         "expandable_segments:True")
        g = max_batch.trial_environment("gpumem", base)
        self.assertNotIn("GPUMEM_CONF", g)
        self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", g)
        with self.assertRaises(ValueError):
            max_batch.trial_environment("cudaMallocAsync", base)
        self.assertEqual(max_batch.gpumem_conf(12884901888), "limit:12884901888")
        self.assertEqual(max_batch.gpumem_conf(5, "footprint:tight"), "limit:5,footprint:tight")
        cmd = max_batch.trial_command("py", "vit_varres", "gpumem", 96, 12884901888, 8,
                                      extra_conf="footprint:tight")
        self.assertEqual(cmd[2:4], ["trial", "vit_varres"])
        self.assertEqual(cmd[cmd.index("--cap-bytes") + 1], "12884901888")
        self.assertEqual(cmd[cmd.index("--gpumem-conf") + 1], "footprint:tight")

    def test_the_trials_arguments_parse(self):
        a = max_batch.parse(max_batch.trial_command("py", "llama_ckpt", "native", 3, 99, 8)[2:])
        self.assertEqual((a.workload, a.batch, a.allocator, a.cap_bytes, a.steps),
                         ("llama_ckpt", 3, "native", 99, 8))
        a = max_batch.parse(["--cap-gib", "12", "--workloads", "fsdp_stack"])
        self.assertEqual((a.cap_gib, a.workloads, a.allocators),
                         (12.0, ["fsdp_stack"], list(max_batch.ALLOCATORS)))

    def test_ratios_and_table(self):
        results = [
            {"workload": "w", "allocator": "gpumem", "max_batch": 30, "samples_per_s": 66.0},
            {"workload": "w", "allocator": "native", "max_batch": 20, "samples_per_s": 60.0},
            {"workload": "w", "allocator": "expandable", "max_batch": 25, "samples_per_s": 50.0},
            {"workload": "v", "allocator": "native", "max_batch": None, "error": "batch 8: boom"},
            {"workload": "v", "allocator": "gpumem", "max_batch": 64, "capped": True}]
        rows = max_batch.summarize(results, ["native", "expandable", "gpumem"])
        self.assertEqual([(r["workload"], r["allocator"]) for r in rows],
                         [("v", "native"), ("v", "gpumem"), ("w", "native"),
                          ("w", "expandable"), ("w", "gpumem")])
        g = rows[-1]
        self.assertEqual((g["ratio_vs_native"], g["ratio_vs_expandable"], g["samples_ratio"]),
                         (1.5, 1.2, 1.1))
        self.assertEqual(rows[1]["ratio_vs_native"], None)
        table = max_batch.markdown(rows, 12 << 30)
        self.assertIn("| w | gpumem | 30 | 1.50× | 1.20× | 66.0 | 1.10× |", table)
        self.assertIn("| v | native | error |", table)
        self.assertIn("| v | gpumem | ≥ 64 |", table)
        self.assertIn("- v / native: batch 8: boom", table)
        self.assertIn("Cap: 12.00 GiB", table)

    def test_the_search_starts_near_the_cap(self):
        self.assertEqual(max_batch.start_batch("vit_varres", 12 << 30), 128)
        self.assertEqual(max_batch.start_batch("vit_varres", 6 << 30), 64)
        self.assertEqual(max_batch.start_batch("llama_ckpt", 1 << 20), 1)


if __name__ == "__main__":
    unittest.main(verbosity=1)
