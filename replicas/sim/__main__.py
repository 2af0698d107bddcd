"""`python -m replicas.sim`: the same as the `fleet-replica` command."""

from replicas.sim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
