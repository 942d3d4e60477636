"""Cluster mode on NATS JetStream: every line of NATS code of this server is in this package.

Connection and requests:

* ``natsconfig``: ``NatsConfig``, importable without nats-py (the settings read it);
* ``conn``: the connection and the shared assets (streams, buckets);
* ``requests``: lean publish-with-ack and batched direct gets;
* ``pullread``: bounded reads of a stream through an ephemeral pull consumer;
* ``retry``: how long an operation retries through a NATS outage;
* ``formats``: what each instance writes and reads, heard from heartbeats.

The record of tasks:

* ``journal``: the ``TaskJournal`` façade and its write path (the event stream is
  each task's record);
* ``records``: the codec of a change and of a snapshot;
* ``snapshots``: the snapshot bucket, and the index entries each snapshot names;
* ``index``: the listing index's stream (entries, markers);
* ``listing``: ``ListTasks`` through the index, and its marker;
* ``ownership``: sweeps of a lost owner's tasks, releases and claims;
* ``keys``: retry keys (safe retries) in their bucket.

Push configs:

* ``pushstore``: push configs and their cursors in their bucket;
* ``deliveries``: which instance delivers each config, and the push marker.

Between instances:

* ``relay``: logs of other instances' tasks, fed from the record;
* ``routing``: CancelTask and follow-ups sent to a task's owner;
* ``signing``: routed requests and answers signed with the cluster key;
* ``lease``: heartbeats, and the survivors' sweep of a lost instance's tasks;
* ``node``: ``NatsCluster``, the ``cluster.Cluster`` of all of the above.
"""
