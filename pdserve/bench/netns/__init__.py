"""Several hosts on one machine: network namespaces on a bridge, a Ray node in each, pdserve
launched over them (``pdserve bench netns-cluster``, scripts/netns_cluster.sh, and the tests in
tests/test_netns_cluster.py). Linux, root, ``ip`` and ``tc`` only."""
