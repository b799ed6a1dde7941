"""The config section of `swiftlm web`, the browser UI over ordinary swiftlm runs. Same
conventions as `config/sections.py`: field names are the flag names, each field's `help` is its
`--help` text, the section checks its own fields when built.
"""

from dataclasses import dataclass

from swiftlm.config.checks import check_fields, custom, within
from swiftlm.config.sections import doc


@dataclass
class WebArguments:
    host: str = doc(
        "Address to bind. The default answers only this machine; the UI starts processes and "
        "reads run directories, so open it wider (0.0.0.0) only with --api_key.",
        default="127.0.0.1",
    )
    port: int = doc("TCP port of the UI (0: a free port, printed).", default=7860)
    api_key: str | None = doc(
        "Key that every page and API call but the login page then needs (`Authorization: "
        "Bearer <key>`, or the cookie the login page sets). None: no authentication.",
        default=None,
    )
    runs_dir: str = doc(
        "Folder where the UI's runs live: each run is RUNS_DIR/<name>, an ordinary run "
        "directory; runs already there (started from a terminal too) are listed.",
        default="output",
    )

    def __post_init__(self):
        check_fields(
            self,
            port=within(0, 65535),
            api_key=custom(
                lambda key: bool(key.strip()),
                "--{flag}: give a non-empty key, or leave it out for no authentication",
            ),
            runs_dir=custom(
                lambda folder: bool(folder.strip()),
                "--{flag}: give the folder where runs live, e.g. output",
            ),
        )
