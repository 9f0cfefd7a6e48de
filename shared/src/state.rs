//! Application state for handlers, as in axum: a handler takes `State<T>` and gets `T` from
//! the state its runtime was given (the consumer's `ConsumerBuilder::state`, the relay's
//! `TaskTransport::state`) — the whole state, or a part of it through [`FromRef`].

/// The application state a handler takes: an `#[idempotent]` consumer handler or a task
/// handler whose first parameter is `State<T>` gets `T` from the state its runtime was given —
/// the whole state, or a part of it through [`FromRef`].
#[derive(Clone, Copy, Debug, Default)]
pub struct State<T>(pub T);

/// Takes a part of the application state: a handler's `State<T>` is built with
/// `T::from_ref(&state)`. Every `Clone` type is its own part; implement `FromRef<AppState>` for
/// each part a handler takes.
#[diagnostic::on_unimplemented(
    message = "a handler takes `State<{Self}>`, but the state given is `{S}`",
    label = "this handler needs `{Self}`",
    note = "give that state with `.state(...)` before `.on(...)`, or implement `FromRef<{S}> for {Self}` to take it from the state"
)]
pub trait FromRef<S> {
    /// The part of `state` a handler takes.
    fn from_ref(state: &S) -> Self;
}

impl<T: Clone> FromRef<T> for T {
    fn from_ref(state: &T) -> Self {
        state.clone()
    }
}
