"""Checkpoints: atomic folders, exact resume, and every engine's file formats, without pickle.

A checkpoint folder holds the model or adapter exactly as `save_pretrained` writes it (so it
loads with transformers/peft as is), the engine's own state beside it, each rank's RNG and
`trainer_state.json`; `COMPLETE` is written last. The engines' formats:

- replicated.py: one full copy (one process, DDP): safetensors weights + optimizer files,
  or (--incremental_checkpoints) content-addressed blocks shared by the run's checkpoints
  with a manifest per checkpoint (blocks.py);
- sharded.py: DCP shards in `dcp/` (FSDP2, tensor parallel), resharded on load;
- stages.py: one folder per pipeline stage;
- deepspeed.py: DeepSpeed's engine folder.

With --async_save the tensors are copied to CPU memory at the save and written by a
background thread (async_write.py; DCP's own for sharded state); COMPLETE waits for them.

`targets.py` picks the checkpoint a run resumes from and names what a folder given as a
checkpoint (or as weights to load) is when it is not one.

Strategies (swiftlm.distributed) call these; nothing here knows a strategy class.
"""

from swiftlm.checkpoint.folders import (
    COMPLETE,
    checkpoint_dir,
    is_complete,
    list_checkpoints,
    mark_complete_when_written,
    prune_checkpoints,
    save_pretrained_atomically,
)
from swiftlm.checkpoint.save import (
    STATE_FILE,
    load_checkpoint,
    load_method_state,
    save_checkpoint,
)
from swiftlm.checkpoint.targets import find_resume_checkpoint
from swiftlm.errors import CheckpointError

__all__ = [
    "COMPLETE",
    "STATE_FILE",
    "CheckpointError",
    "checkpoint_dir",
    "find_resume_checkpoint",
    "is_complete",
    "list_checkpoints",
    "load_checkpoint",
    "load_method_state",
    "mark_complete_when_written",
    "prune_checkpoints",
    "save_checkpoint",
    "save_pretrained_atomically",
]
