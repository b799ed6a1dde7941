"""The config section of `swiftlm report`: which run directories, where the page goes, and
whether to serve it live. Same conventions as `config/sections.py`: field names are the flag names,
each field's `help` is its `--help` text, the section checks its own fields when built.

The run directories are positional on the command line (`swiftlm report RUN_DIR ...`); the
CLI turns them into `--run_dirs` before parsing, so a YAML file may list them too.
"""

from dataclasses import dataclass

from swiftlm.config.checks import check_fields, custom, within
from swiftlm.config.sections import doc


@dataclass
class ReportArguments:
    run_dirs: list[str] = doc(
        "Run directories (the --output_dir of training runs) to report; several overlay their "
        "curves and diff their configs. Usually given positionally: swiftlm report RUN_DIR ...",
        default_factory=list,
    )
    output: str | None = doc(
        "Where to write the page. Default: RUN_DIR/report.html for one run, ./report.html "
        "for several.",
        default=None,
    )
    serve: bool = doc(
        "After writing, serve the first run's page live (updating as steps are logged) on "
        "http://--host:--port until Ctrl-C.",
        default=False,
    )
    port: int = doc("Port of --serve (0: a free port, printed).", default=0)
    host: str = doc(
        "Address of --serve. The default answers only this machine; the page shows the run's "
        "config, so open it wider only on a trusted network.",
        default="127.0.0.1",
    )

    def __post_init__(self):
        check_fields(
            self,
            run_dirs=custom(
                bool, "give at least one run directory: swiftlm report RUN_DIR [RUN_DIR ...]"
            ),
            port=within(0, 65535),
        )
