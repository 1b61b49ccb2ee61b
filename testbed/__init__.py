"""testbed/ - what the tests, the benches and `make demo` use to run the system for real on one
machine: harness.py starts and stops the central services and the sites, fault_harness.py runs
a fault schedule, fault_site.py is its torch-free fake site, fault_oracle.py judges the outcome.
Nothing a site or the central VM runs imports this folder."""
