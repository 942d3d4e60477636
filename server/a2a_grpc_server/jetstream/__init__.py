"""Cluster mode on NATS JetStream: every line of NATS code of this server is in this package.

* ``conn``: the connection and the shared assets (stream, buckets);
* ``requests``: lean publish-with-ack and batched direct gets;
* ``journal``: the ``TaskJournal`` (the event stream is each task's record; KV snapshots);
* ``relay``: logs of other instances' tasks, fed from the record;
* ``routing``: CancelTask and follow-ups sent to a task's owner;
* ``lease``: heartbeats, and the survivors' sweep of a lost instance's tasks;
* ``node``: ``NatsCluster``, the ``cluster.Cluster`` of all of the above.
"""
