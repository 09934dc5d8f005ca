import os as _os

# gs:// paths go through fsspec/gcsfs (a dependency) even where another package pulled TensorFlow in:
# etils.epath would otherwise pick TensorFlow's gfile, a second, untested GCS client. Set before
# anything (Orbax included) asks epath for a backend, which it decides once.
_os.environ.setdefault("EPATH_USE_TF", "false")
