//! The node driver (CSI services, backends, node state). Empty until the node driver issue lands.
