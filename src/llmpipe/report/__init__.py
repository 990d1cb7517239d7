"""The report card's parts: figures, tables, provenance, the HTML page, the headline metrics and the offline
page of `dvc plots show`."""
