//! End-to-end scenarios against testenv or any cluster. Empty until the end-to-end issue lands.
