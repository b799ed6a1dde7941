"""Preference methods: pairs (DPO and its loss family; SimPO, ORPO, CPO without a
reference), unpaired labelled answers (KTO) and reward models (a value head trained on
pairs)."""
