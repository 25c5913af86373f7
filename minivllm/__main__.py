"""``python -m minivllm ...`` is the ``minivllm`` command (:mod:`minivllm.entrypoints.cli`)."""

from minivllm.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
