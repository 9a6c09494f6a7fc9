#!/bin/sh
# Host discovery for elastic jobs: horovodrun runs this every second and uses what it prints,
# one "hostname:slots" per line.  Edit the file to add or remove workers while the job runs:
#   echo "node1:2" > hosts.txt
#   horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script launch/discover_hosts.sh \
#       python -m launch.torch_mnist --elastic
# RINGTRAIN_HOSTS names the file (default: hosts.txt in the current folder).
exec cat "${RINGTRAIN_HOSTS:-hosts.txt}"
