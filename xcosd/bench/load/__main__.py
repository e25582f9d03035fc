"""A device process of ``xcosd bench load`` (started by the parent, which talks to it
over stdin / stdout, see :mod:`xcosd.bench.load.pipe`)."""

from .devices import worker_main

if __name__ == "__main__":
    worker_main()
