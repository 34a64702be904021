//! backend-cpu
