"""Rules between the flags that choose a training run's directory (part of `rules.RULES`).

--overwrite_output_dir (delete the earlier run), --add_version (a fresh versioned subfolder)
and --resume_from_checkpoint (continue a run) each say what happens to the run directory;
the pairs that contradict each other are refused here, before anything loads. What is on disk
is checked later, by `train/rundir.py`.
"""

from swiftlm.config.checks import Rule

RUN_DIR_RULES = (
    Rule(
        "overwrite_or_resume",
        lambda c, f: c.output.overwrite_output_dir and c.output.resume_from_checkpoint is not None,
        "--overwrite_output_dir true deletes the run that --resume_from_checkpoint "
        "{resume_from_checkpoint} continues; drop one of them",
    ),
    Rule(
        "add_version_not_auto",
        lambda c, f: c.output.add_version and c.output.resume_from_checkpoint == "auto",
        "--add_version true writes into a fresh subfolder, where --resume_from_checkpoint auto "
        "finds no checkpoint; to continue a versioned run, pass its folder: "
        "--output_dir {output_dir}/v<N>-<timestamp> --resume_from_checkpoint auto",
    ),
    Rule(
        "overwrite_or_add_version",
        lambda c, f: c.output.overwrite_output_dir and c.output.add_version,
        "--overwrite_output_dir true and --add_version true both given: one deletes the earlier "
        "run in --output_dir {output_dir}, the other keeps it beside a fresh subfolder; drop one "
        "of them",
    ),
)
