//! speech
