"""The desk's window: a web app (runs, one run, the desk) over what the desk identity may read."""
