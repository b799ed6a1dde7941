"""Training methods: the contract (`base.py`), the token methods (`sft.py`, `pt.py`), the
preference methods (`preference/`) and the online ones (`rl/`). `registry.METHODS` maps a
name to its class; `config.py` is the rlhf section and what each rlhf method reads of the
flags. Importing this package loads no method (and no torch), so parsing stays fast.
"""
