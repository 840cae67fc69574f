"""The `asyncrl` command line: subcommands, process supervision, torchrun and Slurm scripts."""
