// mixattn/detail/internal_header_check.hpp — the first include of every header in mixattn/detail/.
//
// The headers under detail/ are the library's internals: their names and signatures change
// without notice, and each assumes what its public header has declared before including it.
// Include a public header (<mixattn/mixattn.hpp>, <mixattn/gma.hpp>, ...) instead; each of them
// includes <mixattn/core.hpp> first, which defines the macro checked here.
#ifndef MIXATTN_CORE_HPP_INCLUDED
#error \
    "the headers in mixattn/detail/ are internal: include a public header such as <mixattn/mixattn.hpp>"
#endif
