"""Train a digits classifier on Ray Train workers: no download, a few CPUs, about a minute.

    python examples/train.py                                   # embedded local Ray, 2 CPU workers
    python examples/train.py num_workers=4 max_duration=3ep    # key=value overrides
    python examples/train.py --config my.yaml storage=s3://my-bucket/runs
    python examples/train.py run_name=digits-1 resume=true     # continue from the newest checkpoint
    python examples/train.py --help                            # every option and config key

scikit-learn's bundled 8x8 digits (1,797 images) are written as Parquet into the run
directory, read back with ray.data.read_parquet and split 1,500 train / 297 eval. An MLP
(or model=cnn) trains with SGD and a cosine schedule with warmup, checkpoints every epoch
into <storage>/<run_name>/checkpoints (keeping 2), shows a progress bar, and prints and
saves a summary (<storage>/<run_name>/summary.json).

Submitted to a cluster (`ray job submit -- python examples/train.py ...`, `ray submit
cluster.yaml examples/train.py`) it joins that cluster instead of starting one. The config
schema and the job live in raytrain_events.cli (`raytrain-events train` runs the same job).
"""

import os
import sys

from raytrain_events.cli.train import example_main

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "digits.yaml")

if __name__ == "__main__":
    sys.exit(example_main(sys.argv[1:], prog="train.py", default_config=DEFAULT_CONFIG))
