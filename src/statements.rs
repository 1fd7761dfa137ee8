//! [`statements_of!`]: how a module names its assembled statements for the catalog
//! ([`crate::sql_catalog`]), kept apart from the catalog so that the modules do not depend on it.

/// Lists a module's statement statics as `(module::NAME, text)`, for [`crate::sql_catalog::catalog`].
macro_rules! statements_of {
    ($($name:ident),+ $(,)?) => {
        /// This module's assembled statements, for [`crate::sql_catalog::catalog`].
        pub(crate) fn statements() -> Vec<(&'static str, &'static str)> {
            vec![$((concat!(module_path!(), "::", stringify!($name)), $name.as_str())),+]
        }
    };
}
pub(crate) use statements_of;
