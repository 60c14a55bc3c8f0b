"""The run's object store (docs/design.md#object-store-transport), from the bottom up: keys.py (what a
key may be, the run's key layout), network.py (s3:// and gs:// options and retries), blobstore.py
(the tensorstore wrapper), json_objects.py (reading JSON objects within bounds), exchange.py
(contributions, acks, broadcasts, gc), control.py (ctl/ objects), poller.py (back-off). It imports
only diloco.algo; callers use the names below (`from diloco import store as bs`).
"""

from diloco.store.blobstore import BlobStore, TooLarge
from diloco.store.control import keep_control, learner_of, list_control, read_control, read_trusted, write_control
from diloco.store.exchange import (OVERSIZED, Published, fetch_fragment, full_versions, gc, get_broadcast, get_frame, latest,
                                   latest_or_rebuilt, parse_pointer, poll_contributions, publish, read_ack,
                                   send_contribution, write_ack)
from diloco.store.json_objects import MAX_COUNT, MAX_JSON_BYTES, is_count, loads_object, read_json
from diloco.store.keys import (LATEST, Key, ack_key, broadcast_key, contribution_key, ctl_key,
                              parse_contribution_key, theta0_key)
from diloco.store.network import StoreUnavailable
from diloco.store.poller import Poller

__all__ = ["LATEST", "MAX_COUNT", "MAX_JSON_BYTES", "OVERSIZED", "BlobStore", "Key", "Poller",
           "Published", "StoreUnavailable", "TooLarge", "ack_key", "broadcast_key", "contribution_key", "ctl_key",
           "fetch_fragment", "full_versions", "gc", "get_broadcast", "get_frame", "is_count", "keep_control", "latest", "learner_of", "latest_or_rebuilt",
           "list_control", "loads_object", "parse_contribution_key", "parse_pointer", "poll_contributions",
           "publish", "read_ack", "read_control", "read_json", "read_trusted", "send_contribution", "theta0_key", "write_ack",
           "write_control"]
