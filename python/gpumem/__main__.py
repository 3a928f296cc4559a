"""python -m gpumem: run a script with gpumem as PyTorch's CUDA allocator.

    python -m gpumem run [--conf K:V,..] [--allocator NAME] [--mark-steps optimizer]
                         SCRIPT.py [ARGS...]
    python -m gpumem run ... -m MODULE [ARGS...]
    python -m gpumem check-conf K:V,..
    python -m gpumem info

The script runs unmodified, as `python SCRIPT.py ARGS...` would run it (sys.argv[0] is the
script, its folder first on sys.path, __name__ == "__main__"); gpumem becomes PyTorch's
allocator as soon as the script imports torch. The options go to the environment
(GPUMEM_CONF, GPUMEM_ALLOCATOR, GPUMEM_MARK_STEPS, GPUMEM_ENABLE=1), so worker processes
started by the script (torchrun, multiprocessing) get gpumem as well where the package is
installed. A bad --conf is refused before the script starts, naming the key.
"""

import argparse
import os
import runpy
import sys

import gpumem
from gpumem import _autoenable

ALLOCATORS = ("vmm_page_pool", "caching_pool")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m gpumem",
                                     description="gpumem as PyTorch's CUDA allocator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a Python script or module with gpumem enabled")
    run.add_argument("--conf", default=None,
                     help="GPUMEM_CONF string, key:value,key:value (see docs/OPTIONS.md)")
    run.add_argument("--allocator", choices=ALLOCATORS, default=None)
    run.add_argument("--mark-steps", choices=("optimizer",), default=None,
                     help="mark a step after every optimizer step (step plans)")
    run.add_argument("-m", dest="module", default=None, help="run a module as python -m does")
    run.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT.py [ARGS...]")
    check = sub.add_parser("check-conf", help="check a GPUMEM_CONF string and exit")
    check.add_argument("conf")
    sub.add_parser("info", help="the library found and its version")
    return parser


def _fail(text):
    sys.stderr.write("python -m gpumem: %s\n" % text)
    return 2


def _configure(args):
    conf = args.conf if args.conf is not None else os.environ.get("GPUMEM_CONF", "")
    gpumem.check_config(conf)
    if args.conf is not None:
        os.environ["GPUMEM_CONF"] = args.conf
    if args.allocator is not None:
        os.environ["GPUMEM_ALLOCATOR"] = args.allocator
    if args.mark_steps is not None:
        os.environ["GPUMEM_MARK_STEPS"] = args.mark_steps
    os.environ["GPUMEM_ENABLE"] = "1"


def _run(args):
    target = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if args.module is None and not target:
        return _fail("run: name the script to run (python -m gpumem run train.py ARGS...)")
    if args.module is None and not os.path.exists(target[0]):
        return _fail("run: no such script: %s" % target[0])
    try:
        _configure(args)
    except gpumem.GpumemError as e:
        return _fail(str(e))
    _autoenable.install()
    if args.module is not None:
        sys.argv = [args.module] + target
        sys.path.insert(0, os.getcwd())
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    else:
        script = target[0]
        sys.argv = target
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    return 0


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "check-conf":
        try:
            gpumem.check_config(args.conf)
        except gpumem.GpumemError as e:
            return _fail(str(e))
        print("ok")
        return 0
    print("gpumem %s: %s" % (gpumem.version(), gpumem.library_path()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
