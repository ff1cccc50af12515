"""A worker rank of a DiT group (`services/dit/parallel.py`): started by rank 0 as
`python -m stagemesh.services.dit.parallel_worker <model_dir> <options as JSON>`, it loads the
same transformer, joins the group and runs its share of every forward until rank 0 stops it.
It dies with rank 0 (PR_SET_PDEATHSIG); anything it raises ends it with status 1, which rank 0
sees as a group fault."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from stagemesh.shared.process import die_with_parent, stage_threads, stay_offline

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    stay_offline()
    die_with_parent()
    import torch
    import torch.distributed as dist

    from stagemesh.services.dit import parallel
    from stagemesh.services.dit.servicer import group_family

    torch.set_num_threads(stage_threads("dit"))
    model_dir, options = Path(argv[0]), json.loads(argv[1])
    rank, world = int(os.environ[parallel.RANK_ENV]), int(os.environ[parallel.WORLD_ENV])
    family, degrees = group_family(model_dir, options)
    parallel.join_group(rank, world, int(os.environ[parallel.PORT_ENV]))
    group = parallel.shard_family(family, degrees, rank)
    log.info("DiT group rank %d of %d serving", rank, world)
    group.serve()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(main(sys.argv[1:]))
