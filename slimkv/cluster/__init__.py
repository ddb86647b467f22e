"""Scale-out: N engine replicas behind one OpenAI endpoint on Ray Serve.

``policy`` (the routing rule) and ``hashing`` are pure Python and import no Ray, so the
multi-replica simulator can call them; the Ray modules (``router``, ``replica``,
``ingress``, ``launch``) import Ray only when a cluster is started.
"""
