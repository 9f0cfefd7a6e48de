//! Builder-style setters for Postal's configuration structs. They are `#[non_exhaustive]`, so
//! code outside their crate builds them from `new`/`default` and these setters:
//! `RelayConfig::default().lanes(2).group("reports".into())`.

/// Generates, for each listed field, `pub fn field(self, value) -> Self`.
#[doc(hidden)]
#[macro_export]
macro_rules! setters {
    ($ty:ident { $($field:ident: $t:ty),* $(,)? }) => {
        impl $ty {
            $(
                #[doc = concat!("Sets `", stringify!($field), "` (the field of that name says what it does).")]
                #[must_use]
                pub fn $field(mut self, $field: $t) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}
