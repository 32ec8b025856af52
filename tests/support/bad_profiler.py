"""Invalid `profiler:` sections the parser tests and the Trainer tests share."""


# Invalid `profiler:` sections and the key each error must name (item 1 of the profiler issue):
# the parser tests and the Trainer tests run the same list.
BAD_PROFILER_SECTIONS = [
    ({"start_step": 0, "end_step": 3}, "profiler.start_step"),
    ({"start_step": 2, "end_step": -1}, "profiler.end_step"),
    ({"start_step": 5, "end_step": 3}, "profiler.end_step"),
    ({"start_step": 5}, "profiler.end_step"),
    ({"profiler_level": "Level1"}, "profiler.profiler_level"),
    ({"profiler_level": True}, "profiler.profiler_level"),
    ({"profiler_level": 1.0}, "profiler.profiler_level"),
]
