"""`swiftlm report` and the live dashboard: what a run directory holds, drawn as one page.

`run_data.py` reads what a training run left in its run directory, `cards.py` (with
`figures.py` and `tables.py`) turns it into cards of plots and tables, `page.py` renders the
page, `run.py` writes `report.html` (the command, and the page a finished training run
writes), and `dashboard.py` serves the same page live while a run trains. It only reads run
directories: what watches a run while it trains (metrics, loggers, health) is `monitor/`.
"""
