"""gcsfs with the project's retry count (paths.STORAGE_RETRIES): registered by name for gs:// in paths.py, so
gcsfs and its imports load only when a run first opens a gs:// path."""

import gcsfs

from pacs_jax.paths import STORAGE_RETRIES


class GCSFileSystem(gcsfs.GCSFileSystem):
  """gcsfs with STORAGE_RETRIES.attempts per request (its retry decorator fixes the count at class definition)."""
  _request = gcsfs.retry.retry_request(retries=STORAGE_RETRIES.attempts)(gcsfs.GCSFileSystem._request.__wrapped__)
