"""After-the-run tools: they read what the sinks wrote (through mindmon.formats) and never run on
the training path. `mindmon report`, `parse-log`, `merge`, `to-tensorboard`, `profile-summary`."""
