"""outer_defaults.py - the outer step's defaults, said once: Nesterov, lr 0.7, momentum 0.9.

Runs on: everywhere, imported; imports nothing, so the central VM (no torch) reads it
beside the sites. The aggregator's fedmom_server.py --outer-lr / --outer-momentum
(fedmom_state.ServerConfig) and DiLoCo's --diloco-outer-lr / --diloco-outer-momentum
inside one allocation (train_config.py, which gives them to diloco.DiLoCoConfig) default
to these, as do demo.py and bench/convergence.py's Nesterov arms.

Source: DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models"): outer Nesterov momentum 0.9 with an outer learning rate of 0.7
beat plain averaging and outer Adam at H = 500 inner steps. lr 1.0 with momentum 0 makes
the outer step theta = the (weighted) mean of the replicas: exact FedAvg, the control arm.
"""

OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
