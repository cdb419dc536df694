"""Command line for the Gram Newton-Schulz restart autotune.

Usage::

    python -m dion3_jax.restarts --coefficients polar_express [--steps N] [--spurious -4e-4]
        [--max-growth X] [--max-restarts K] [--num-restarts K]

See :func:`dion3_jax._restarts.autotune_restarts` for the criterion.
"""

from dion3_jax._restarts import main

if __name__ == "__main__":
    raise SystemExit(main())
