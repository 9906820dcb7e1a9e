// Symbol visibility: the library is built with hidden visibility; MOE_API marks the public ABI.
#pragma once

#if defined(_WIN32)
#define MOE_API
#elif defined(MOE_ENGINE_BUILDING)
#define MOE_API __attribute__((visibility("default")))
#else
#define MOE_API
#endif
